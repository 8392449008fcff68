"""Goldens that cannot lie (issue #13 cases 2, 7 and 8): "no golden" is its own state, a bless
is refused when the run's own checks fail, provenance is kept per backend (a partial bless leaves
the other backends STALE), and any config change makes a golden STALE.

A second backend costs a process group on CPU; here ``fsdp`` is served in-process by the
reference backend (patched registry): these tests are about the golden store, not about FSDP.
"""

from __future__ import annotations

import json
import shutil

import pytest
from reltools import REPO, scenario_dict, tree_digest, write_scenario

from rlaudit.backends import registry
from rlaudit.scenarios.invariants import INVARIANTS
from rlaudit.verdict.result import FAIL, CheckResult

OTHER_ROLLOUT = REPO / "scenarios" / "rollouts" / "short-distill.safetensors"


@pytest.fixture(scope="module", autouse=True)
def fsdp_in_process():
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(registry._BACKENDS, "fsdp", ("rlaudit.backends.reference", "ReferenceBackend"))
        yield


def two_backends(**over) -> dict:
    return scenario_dict(backends={"reference": {}, "fsdp": {}}, **over)


@pytest.fixture(scope="module")
def blessed(tmp_path_factory):
    """A scenario on two backends and its freshly blessed golden (the CLI's `golden bless`)."""
    from rlaudit.cli.main import main
    root = tmp_path_factory.mktemp("blessed")
    scn = write_scenario(root / "scn" / "duo.yaml", two_backends())
    gdir = root / "golden"
    assert main(["golden", "bless", "duo", "--scenarios-dir", str(root / "scn"),
                 "--golden-dir", str(gdir)]) == 1  # a bless never exits 0
    return scn, gdir


def copy_golden(blessed, tmp_path):
    scn, gdir = blessed
    d = tmp_path / "golden"
    shutil.copytree(gdir, d)
    return scn, d


def run(cli, scn, gdir, tmp_path, *extra):
    return cli("run", scn, "--golden-dir", gdir, "--report-dir", tmp_path / "reports",
               "--no-mlflow", *extra)


def test_blessed_golden_records_provenance_per_backend(blessed):
    _, gdir = blessed
    doc = json.loads((gdir / "duo.json").read_text())
    assert set(doc["backends"]) == {"reference@cpu", "fsdp@cpu"}
    (sha, record), = doc["configs"].items()
    for entry in doc["backends"].values():
        prov = entry["provenance"]
        assert prov["config_sha"] == sha and prov["semantics"] >= 1 and prov["rollout_sha"]
    assert record["actor.logprob_chunk_size"] == 256 and record["steps"] == 1


def test_case2_no_golden_is_its_own_state_and_require_golden_fails(cli, tmp_path):
    scn = write_scenario(tmp_path / "solo.yaml")
    res = run(cli, scn, tmp_path / "golden", tmp_path, "--json")
    assert res.rc == 0, res.err
    (r,) = json.loads(res.out)
    assert r["state"] == "no golden" and r["passed"] is False
    assert [g["status"] for g in r["golden"]] == ["no golden"]
    res = run(cli, scn, tmp_path / "golden", tmp_path, "--require-golden")
    assert res.rc == 1
    assert "solo: NO GOLDEN" in res.out and "0/1 scenarios passed (1 no golden)" in res.out
    assert "golden         no golden" in res.out  # the table's golden row
    assert not (tmp_path / "golden").exists()


def test_case7_bless_is_refused_when_an_invariant_failed(cli, tmp_path, monkeypatch, blessed):
    """An injected failure of sanity-bounds: `golden bless` and `run --bless` write nothing and
    exit 1; with --force the bless goes through."""
    scn, gdir = copy_golden(blessed, tmp_path)
    # an old bless time, so that a bless now changes the file even within the fixture's second
    doc = json.loads((gdir / "duo.json").read_text())
    for entry in doc["backends"].values():
        entry["provenance"]["blessed_at"] = "2000-01-01T00:00:00+00:00"
    (gdir / "duo.json").write_text(json.dumps(doc, indent=1))
    before = tree_digest(gdir)
    inv = INVARIANTS.get("sanity-bounds")
    monkeypatch.setattr(inv, "check", lambda ctx: [
        CheckResult("sanity-bounds", b, FAIL, "injected failure") for b in ctx.backends()])
    args = ["--scenarios-dir", scn.parent, "--golden-dir", gdir, "--backend", "reference"]
    res = cli("golden", "bless", "duo", *args)
    assert res.rc == 1
    assert "bless refused for duo (nothing written)" in res.err
    assert "golden         REFUSED" in res.out
    assert "sanity-bounds fail on reference" in res.out
    assert tree_digest(gdir) == before
    res = run(cli, scn, gdir, tmp_path, "--bless", "--backend", "reference")
    assert res.rc == 1 and "duo: FAILED" in res.out and tree_digest(gdir) == before
    res = cli("golden", "bless", "duo", *args, "--force")
    assert res.rc == 1 and "goldens regenerated" in res.err
    assert tree_digest(gdir) != before


def test_case7_partial_bless_leaves_the_other_backend_stale(cli, tmp_path, blessed):
    """After a rollout change, blessing fsdp alone stamps the new rollout on fsdp's entry only:
    the reference entry keeps its own provenance and reports STALE instead of comparing values
    from the old rollout."""
    scn, gdir = copy_golden(blessed, tmp_path)
    write_scenario(scn, two_backends(rollout=str(OTHER_ROLLOUT)))
    res = cli("golden", "bless", "duo", "--scenarios-dir", scn.parent, "--golden-dir", gdir,
              "--backend", "fsdp")
    assert res.rc == 1, res.err
    doc = json.loads((gdir / "duo.json").read_text())
    ref, fsdp = (doc["backends"][k]["provenance"] for k in ("reference@cpu", "fsdp@cpu"))
    assert ref["rollout_sha"] != fsdp["rollout_sha"]
    before = tree_digest(gdir)
    res = run(cli, scn, gdir, tmp_path, "--json")
    assert res.rc == 1
    (r,) = json.loads(res.out)
    status = {g["backend"]: g["status"] for g in r["golden"]}
    assert status == {"reference": "stale", "fsdp": "pass"}
    msg = next(g["message"] for g in r["golden"] if g["backend"] == "reference")
    assert "a different rollout" in msg and "reference@cpu" in msg
    assert r["state"] == "failed" and tree_digest(gdir) == before


def test_case8_a_config_change_that_moves_no_metric_is_stale(cli, tmp_path, blessed):
    """logprob_chunk_size only changes how log-probs are chunked, not their values: compared,
    the run would pass against a golden blessed for another config. It is STALE instead."""
    scn, gdir = copy_golden(blessed, tmp_path)
    d = two_backends()
    d["config"]["actor"]["logprob_chunk_size"] = 128
    write_scenario(scn, d)
    before = tree_digest(gdir)
    res = run(cli, scn, gdir, tmp_path, "--backend", "reference")
    assert res.rc == 1
    assert "golden STALE [reference]" in res.out
    assert "config changed (actor.logprob_chunk_size: 256 -> 128)" in res.out
    assert tree_digest(gdir) == before
    assert not (gdir / "duo.obtained.json").exists()  # stale: not compared
