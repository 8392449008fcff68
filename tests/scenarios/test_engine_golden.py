"""The scenario engine on a tiny scenario (reference backend) and the golden store: bless, pass,
fail with an obtained file, stale, missing, corrupt inputs, atomic writes."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml

from rlaudit.cli.main import main
from rlaudit.errors import InputError
from rlaudit.metrics import CATALOGUE
from rlaudit.scenarios import golden as golden_mod
from rlaudit.scenarios.engine import run_scenario
from rlaudit.scenarios.spec import load_scenario

REPO = Path(__file__).resolve().parents[2]
MODEL = REPO / "scenarios" / "models" / "qwen2-tiny-short"
ROLLOUT = REPO / "scenarios" / "rollouts" / "short-ref.safetensors"
SIDECAR = json.loads(ROLLOUT.with_suffix(".json").read_text())
INVARIANTS = ["sanity-bounds", "on-policy-identities", "microbatch-invariance"]
#: pg_loss gets a scenario tolerance (1 %); every other metric the dtype's golden default
PG_RTOL = 0.01


def scenario_dict(**over) -> dict:
    d = {"description": "tiny engine test", "model": str(MODEL), "rollout": str(ROLLOUT),
         "steps": 2, "dtype": "float64",
         "config": {"rollout": {"n": 4, "response_length": 12},
                    "actor": {"ppo_mini_batch_size": 2, "ppo_micro_batch_size_per_gpu": 2,
                              "calculate_entropy": True, "optim": {"name": "sgd", "lr": 0.05}}},
         "backends": {"reference": {}},
         "invariants": INVARIANTS,
         "tolerances": {"actor/pg_loss": {"rtol": PG_RTOL, "atol": 0.0}}}
    d.update(over)
    return d


def write_scenario(path: Path, **over) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(scenario_dict(**over)))
    return path


@pytest.fixture(scope="module")
def blessed(tmp_path_factory):
    """(scenario, golden dir, the blessing result, a normal run's result against the golden)."""
    root = tmp_path_factory.mktemp("engine")
    scn = load_scenario(write_scenario(root / "tiny_engine.yaml"))
    gdir = root / "golden"
    bless = run_scenario(scn, golden_dir=gdir, bless=True)
    normal = run_scenario(scn, golden_dir=gdir)
    return scn, gdir, bless, normal


def golden_copy(blessed, tmp_path) -> tuple[Path, dict]:
    scn, gdir, _, _ = blessed
    d = tmp_path / "golden"
    d.mkdir()
    shutil.copy(gdir / f"{scn.name}.json", d / f"{scn.name}.json")
    return d, json.loads((d / f"{scn.name}.json").read_text())


def test_invariants_pass_on_the_reference_backend(blessed):
    _, _, _, res = blessed
    assert res.errors == {}
    by_inv = {c.invariant: c.status for c in res.checks}
    assert set(by_inv) == set(INVARIANTS)
    assert all(c.status == "pass" and c.backend == "reference" for c in res.checks)
    assert len(res.metrics["reference"]) == 2  # steps: 2
    assert res.backends == ["reference"]
    assert res.provenance["rollout_sha"] == SIDECAR["sha256"]


def test_bless_writes_a_diffable_golden_and_does_not_pass(blessed):
    scn, gdir, res, _ = blessed
    assert not res.passed
    assert [(g.backend, g.status) for g in res.golden] == [("reference", "blessed")]
    # only the golden: no temporaries, no obtained file
    assert sorted(p.name for p in gdir.iterdir()) == [f"{scn.name}.json"]
    text = (gdir / f"{scn.name}.json").read_text()
    doc = json.loads(text)

    def assert_sorted(obj):
        if isinstance(obj, dict):
            assert list(obj) == sorted(obj)
            for v in obj.values():
                assert_sorted(v)
        elif isinstance(obj, list):
            for v in obj:
                assert_sorted(v)
    assert_sorted(doc)
    assert text.count("\n") > 100  # one key per line: a reviewable `git diff`
    assert doc["scenario"] == scn.name
    prov = doc["backends"]["reference@cpu"]["provenance"]
    # the committed rollout's own sidecar says which tensors and which model it came from
    assert prov["rollout_sha"] == SIDECAR["sha256"]
    assert prov["model_sha"] == SIDECAR["meta"]["model_snapshot_id"]
    assert prov["dtype"] == "float64" and prov["blessed_at"]
    assert prov["semantics"] == golden_mod.SEMANTICS_VERSION and prov["layout"] == {}
    # the config record: the scenario's resolved config (defaults filled in) and its sha
    (sha, record), = doc["configs"].items()
    assert prov["config_sha"] == sha
    assert record["actor.optim.lr"] == 0.05 and record["steps"] == 2
    assert record["actor.clip_ratio_c"] == 3.0  # a default the scenario does not set
    assert list(doc["backends"]) == ["reference@cpu"]
    steps = doc["backends"]["reference@cpu"]["steps"]
    assert len(steps) == 2
    for got, entry in zip(res.metrics["reference"], steps):
        assert "actor/pg_loss" in entry and "actor/entropy" in entry
        assert not [n for n in entry if n.startswith("timing/")]
        assert set(entry) <= set(CATALOGUE)
        for name, w in entry.items():
            assert set(w) == {"value", "rtol", "atol"}
            assert w["value"] == got[name]
            assert w["rtol"] >= 0 and w["atol"] >= 0 and w["rtol"] + w["atol"] > 0
        assert entry["actor/pg_loss"]["rtol"] == PG_RTOL and entry["actor/pg_loss"]["atol"] == 0


def test_a_normal_run_passes_against_the_golden(blessed):
    scn, gdir, _, res = blessed
    assert res.passed
    (g,) = res.golden
    assert g.status == "pass" and g.mismatches == []
    doc = json.loads((gdir / f"{scn.name}.json").read_text())
    n_metrics = sum(len(s) for s in doc["backends"]["reference@cpu"]["steps"])
    assert len(g.rows) == n_metrics and all(r["ok"] for r in g.rows)
    assert not (gdir / f"{scn.name}.obtained.json").exists()


def test_a_golden_value_off_by_more_than_its_tolerance_fails(blessed, tmp_path):
    scn, _, _, _ = blessed
    gdir, doc = golden_copy(blessed, tmp_path)
    entry = doc["backends"]["reference@cpu"]["steps"][1]["actor/entropy"]
    true_value = entry["value"]
    entry["value"] = true_value * 1.01  # 1 %, far beyond the float64 golden tolerance
    (gdir / f"{scn.name}.json").write_text(json.dumps(doc))
    res = run_scenario(scn, golden_dir=gdir)
    assert not res.passed
    assert all(c.status == "pass" for c in res.checks)  # only the golden fails
    (g,) = res.golden
    assert g.status == "fail"
    assert "actor/entropy" in g.message and "step 1" in g.message
    assert [(m["metric"], m["step"]) for m in g.mismatches] == [("actor/entropy", 1)]
    obtained = gdir / f"{scn.name}.obtained.json"
    assert obtained.exists()
    got = json.loads(obtained.read_text())
    assert got["backends"]["reference@cpu"]["steps"][1]["actor/entropy"]["value"] == \
        pytest.approx(true_value, rel=1e-12)
    # fixing the golden: the next (passing) comparison removes the obtained file again
    entry["value"] = true_value
    (gdir / f"{scn.name}.json").write_text(json.dumps(doc))
    (g,) = golden_mod.compare_or_bless(scn, res.runs, gdir, bless=False)
    assert g.status == "pass"
    assert not obtained.exists()
    assert sorted(p.name for p in gdir.iterdir()) == [f"{scn.name}.json"]


@pytest.mark.parametrize("factor,status", [(1 + PG_RTOL / 2, "pass"), (1 + 2 * PG_RTOL, "fail"),
                                           (1 - 2 * PG_RTOL, "fail")])
def test_per_metric_tolerance_from_the_scenario(blessed, tmp_path, factor, status):
    scn, _, _, res = blessed
    gdir, doc = golden_copy(blessed, tmp_path)
    entry = doc["backends"]["reference@cpu"]["steps"][0]["actor/pg_loss"]
    assert abs(entry["value"]) > 1e-3  # a value the factor visibly moves
    entry["value"] *= factor
    (gdir / f"{scn.name}.json").write_text(json.dumps(doc))
    (g,) = golden_mod.compare_or_bless(scn, res.runs, gdir, bless=False)
    assert g.status == status, g.message
    if status == "fail":
        assert "actor/pg_loss step 0" in g.message


def test_a_missing_or_extra_metric_fails(blessed, tmp_path):
    scn, _, _, res = blessed
    gdir, doc = golden_copy(blessed, tmp_path)
    steps = doc["backends"]["reference@cpu"]["steps"]
    del steps[0]["actor/entropy"]
    steps[1]["actor/made_up"] = {"value": 1.0, "rtol": 0.0, "atol": 0.0}
    (gdir / f"{scn.name}.json").write_text(json.dumps(doc))
    (g,) = golden_mod.compare_or_bless(scn, res.runs, gdir, bless=False)
    assert g.status == "fail"
    found = {(m["metric"], m["step"]) for m in g.mismatches}
    assert found == {("actor/entropy", 0), ("actor/made_up", 1)}
    del steps[1]
    (gdir / f"{scn.name}.json").write_text(json.dumps(doc))
    (g,) = golden_mod.compare_or_bless(scn, res.runs, gdir, bless=False)
    assert g.status == "fail" and "2 steps run, golden has 1" in g.message


@pytest.mark.parametrize("field,word", [("rollout_sha", "rollout"), ("model_sha", "model"),
                                        ("ref_model_sha", "reference model"),
                                        ("semantics", "semantics version 0"),
                                        ("layout", "layout")])
def test_changed_provenance_is_stale_and_not_compared(blessed, tmp_path, field, word):
    scn, _, _, res = blessed
    gdir, doc = golden_copy(blessed, tmp_path)
    prov = doc["backends"]["reference@cpu"]["provenance"]
    prov[field] = {"semantics": 0, "layout": {"dp": 2}}.get(field, "0" * 16)
    for step in doc["backends"]["reference@cpu"]["steps"]:  # would fail if compared
        for w in step.values():
            w["value"] += 1.0
    (gdir / f"{scn.name}.json").write_text(json.dumps(doc))
    (g,) = golden_mod.compare_or_bless(scn, res.runs, gdir, bless=False)
    assert g.status == "stale"
    assert word in g.message and "re-bless" in g.message
    assert g.rows == [] and g.mismatches == []
    assert not (gdir / f"{scn.name}.obtained.json").exists()
    res.golden = [g]
    assert not res.passed


def test_missing_golden_is_its_own_state_not_a_pass(blessed, tmp_path):
    scn, _, _, res = blessed
    (g,) = golden_mod.compare_or_bless(scn, res.runs, tmp_path, bless=False)
    assert g.status == "no golden"
    assert f"rlaudit golden bless {scn.name}" in g.message
    assert list(tmp_path.iterdir()) == []
    res.golden = [g]
    assert not res.passed and res.state == "no golden"


def test_golden_without_this_backend_is_missing(blessed, tmp_path):
    scn, _, _, res = blessed
    gdir, doc = golden_copy(blessed, tmp_path)
    doc["backends"] = {"reference@cuda": doc["backends"]["reference@cpu"]}
    (gdir / f"{scn.name}.json").write_text(json.dumps(doc))
    (g,) = golden_mod.compare_or_bless(scn, res.runs, gdir, bless=False)
    assert g.status == "no golden" and "reference@cpu" in g.message


def test_blessing_a_subset_keeps_other_backends_entries(blessed, tmp_path):
    scn, _, _, res = blessed
    gdir, doc = golden_copy(blessed, tmp_path)
    gpu = {"provenance": {"semantics": 1, "layout": {"dp": 2}},  # an entry needs one
           "steps": [{"actor/pg_loss": {"value": 9.0, "rtol": 0.1, "atol": 0.0}}]}
    doc["backends"]["fsdp@cuda"] = gpu
    (gdir / f"{scn.name}.json").write_text(json.dumps(doc))
    (g,) = golden_mod.compare_or_bless(scn, res.runs, gdir, bless=True)
    assert g.status == "blessed"
    new = json.loads((gdir / f"{scn.name}.json").read_text())
    assert new["backends"]["fsdp@cuda"] == gpu
    assert new["backends"]["reference@cpu"]["steps"][0]["actor/pg_loss"]["value"] == \
        res.metrics["reference"][0]["actor/pg_loss"]


@pytest.mark.parametrize("mutate,key", [
    (lambda d: [1, 2], None),
    (lambda d: {**d, "provenance": None}, "provenance"),
    (lambda d: {**d, "backends": {"reference@cpu": []}}, "backends.reference@cpu"),
    (lambda d: {**d, "backends": {"reference@cpu": {"steps": [{"actor/pg_loss": {"value": 1}}]}}},
     "backends.reference@cpu.steps[0].actor/pg_loss"),
    (lambda d: {**d, "backends": {"reference@cpu": {"steps": [
        {"actor/pg_loss": {"value": "x", "rtol": 0, "atol": 0}}]}}},
     "backends.reference@cpu.steps[0].actor/pg_loss.value"),
])
def test_malformed_golden_is_an_input_error(blessed, tmp_path, mutate, key):
    """A hand-edited golden that is valid JSON but not a golden names file and key."""
    scn, _, _, res = blessed
    gdir, doc = golden_copy(blessed, tmp_path)
    path = gdir / f"{scn.name}.json"
    path.write_text(json.dumps(mutate(doc)))
    for bless in (False, True):  # blessing must not silently drop what it cannot read
        with pytest.raises(InputError) as e:
            golden_mod.compare_or_bless(scn, res.runs, gdir, bless=bless)
        assert e.value.source == str(path) and e.value.key == key
    path.write_text("{not json")
    with pytest.raises(InputError, match="not valid JSON") as e:
        golden_mod.compare_or_bless(scn, res.runs, gdir, bless=False)
    assert e.value.source == str(path)


def test_golden_write_is_atomic(blessed, tmp_path, monkeypatch):
    """A crash while writing leaves the old golden intact and no temporary file behind."""
    scn, _, _, res = blessed
    gdir, doc = golden_copy(blessed, tmp_path)
    path = gdir / f"{scn.name}.json"
    before = path.read_bytes()

    def crash(*a, **k):
        raise OSError("disk full")
    monkeypatch.setattr(golden_mod.json, "dump", crash)
    with pytest.raises(OSError, match="disk full"):
        golden_mod.compare_or_bless(scn, res.runs, gdir, bless=True)
    assert path.read_bytes() == before
    assert sorted(p.name for p in gdir.iterdir()) == [path.name]
    monkeypatch.undo()
    golden_mod.compare_or_bless(scn, res.runs, gdir, bless=True)
    assert sorted(p.name for p in gdir.iterdir()) == [path.name]
    assert (path.stat().st_mode & 0o777) == 0o644


def _broken_rollout(tmp_path: Path, how: str) -> Path:
    dst = tmp_path / "rollouts" / "broken.safetensors"
    dst.parent.mkdir()
    shutil.copy(ROLLOUT, dst)
    shutil.copy(ROLLOUT.with_suffix(".json"), dst.with_suffix(".json"))
    data = bytearray(dst.read_bytes())
    if how == "truncated":
        data = data[: len(data) // 2]
    else:  # flip one byte of tensor data (the end of the file is tensor data, not the header)
        data[-3] ^= 0xFF
    dst.write_bytes(bytes(data))
    return dst


@pytest.mark.parametrize("how", ["truncated", "corrupt"])
def test_broken_rollout_is_an_input_error_naming_the_file(tmp_path, capsys, how):
    rollout = _broken_rollout(tmp_path, how)
    path = write_scenario(tmp_path / "uses_broken.yaml", rollout=str(rollout),
                          invariants=["sanity-bounds"], steps=1)
    scn = load_scenario(path)  # the file exists: loading the spec is fine
    with pytest.raises(InputError) as e:
        run_scenario(scn, golden_dir=tmp_path / "golden")
    assert e.value.source == str(rollout)
    rc = main(["run", str(path), "--no-mlflow", "--report-dir", str(tmp_path / "rep"),
               "--golden-dir", str(tmp_path / "golden")])
    assert rc == 2
    assert str(rollout) in capsys.readouterr().err
    assert not (tmp_path / "golden").exists()


@pytest.mark.slow
def test_cli_golden_bless_exits_1_and_a_rerun_passes(tmp_path, capsys):
    path = write_scenario(tmp_path / "scn" / "tiny_bless.yaml", steps=1,
                          invariants=["sanity-bounds"])
    gdir = tmp_path / "golden"
    args = ["--scenarios-dir", str(tmp_path / "scn"), "--golden-dir", str(gdir)]
    assert main(["golden", "bless", "tiny_bless", *args]) == 1
    out, err = capsys.readouterr()
    assert "BLESSED" in out and "review" in err
    assert sorted(p.name for p in gdir.iterdir()) == ["tiny_bless.json"]
    assert main(["run", str(path), "--no-mlflow", "--report-dir", str(tmp_path / "rep"),
                 *args]) == 0
    out, _ = capsys.readouterr()
    assert "tiny_bless: PASSED" in out
    assert main(["run", "tiny_bless", "--bless", "--no-mlflow", "--report-dir",
                 str(tmp_path / "rep"), *args]) == 1


def test_config_temperature_other_than_the_rollouts_is_an_input_error(tmp_path, capsys):
    """short-ref was sampled at temperature 1.0 (its sidecar says so); a scenario that replays
    it at 0.7 would fail every sampler-vs-trainer comparison for the scenario's own fault."""
    assert SIDECAR["meta"]["sampling"]["temperature"] == 1.0
    d = scenario_dict(steps=1, invariants=["sanity-bounds"])
    d["config"]["rollout"]["temperature"] = 0.7
    path = tmp_path / "hot.yaml"
    path.write_text(yaml.safe_dump(d))
    with pytest.raises(InputError) as e:
        run_scenario(load_scenario(path), golden_dir=tmp_path / "golden")
    assert e.value.key == "config.rollout.temperature" and e.value.source == str(path)
    assert "1.0" in str(e.value) and "0.7" in str(e.value)
    rc = main(["run", str(path), "--no-mlflow", "--report-dir", str(tmp_path / "rep"),
               "--golden-dir", str(tmp_path / "golden")])
    assert rc == 2 and "config.rollout.temperature" in capsys.readouterr().err
    assert not (tmp_path / "golden").exists()
