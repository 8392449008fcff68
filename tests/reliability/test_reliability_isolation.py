"""A failure inside one scenario is that scenario's result (issue #13 case 3): the other
scenarios run, and everything finished is logged to MLflow, reported and summarised."""

from __future__ import annotations

import json
import shutil
import sqlite3

import pytest
from reltools import ROLLOUT, write_scenario

from rlaudit.errors import InputError
from rlaudit.scenarios import engine
from rlaudit.scenarios.outcome import exit_code, run_isolated
from rlaudit.verdict.result import BAD_INPUT, FAILED, NO_GOLDEN_STATE, ScenarioResult
from rlaudit.scenarios.spec import load_scenario


def _rollout_copy(tmp):
    dst = tmp / "rollouts" / "late.safetensors"
    dst.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(ROLLOUT, dst)
    shutil.copy(ROLLOUT.with_suffix(".json"), dst.with_suffix(".json"))
    return dst


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:The ``noload`` loader strategy")  # mlflow's sqlalchemy use
def test_case3_late_bad_input_is_that_scenarios_result_and_the_rest_is_kept(
        cli, tmp_path, monkeypatch, first_runs):
    """b's rollout is truncated after the validation pass (a concurrent `rlaudit record` over
    it, say): b is "bad input" naming the file; a and c run; all three are in the table, the
    summary, the local report and MLflow; the exit code is 2."""
    rollout = _rollout_copy(tmp_path)  # b's own copy; a and c replay the committed one
    scns = [write_scenario(tmp_path / "scn" / f"{n}.yaml",
                           rollout=str(rollout if n == "b" else ROLLOUT)) for n in ("a", "b", "c")]
    real = engine.run_scenario

    def run_scenario(scn, **kw):
        if scn.name == "b":
            rollout.write_bytes(rollout.read_bytes()[:100])
        return real(scn, **kw)
    monkeypatch.setattr(engine, "run_scenario", run_scenario)
    store = tmp_path / "store" / "mlflow.db"
    store.parent.mkdir()
    shutil.copy(first_runs[1], store)
    res = cli("run", *scns, "--golden-dir", tmp_path / "golden", "--report-dir",
              tmp_path / "reports", "--tracking-uri", f"sqlite:///{store}")
    assert res.rc == 2, res.err
    assert "a: NO GOLDEN" in res.out and "c: NO GOLDEN" in res.out and "b: BAD INPUT" in res.out
    assert f"bad input: {rollout}: not a readable safetensors file" in res.out
    assert "0/3 scenarios passed (1 bad input, 2 no golden)" in res.out
    assert "logged 3 scenario(s)" in res.err
    md = (tmp_path / "reports" / "latest" / "report.md").read_text()
    assert "## a: NO GOLDEN" in md and "## b: BAD INPUT" in md and "## c: NO GOLDEN" in md
    with sqlite3.connect(store) as con:
        rows = con.execute("select r.name, t.value from runs r join tags t on r.run_uuid = "
                           "t.run_uuid where t.key = 'rlaudit.state'").fetchall()
        err_tag = con.execute("select t.value from runs r join tags t on r.run_uuid = "
                              "t.run_uuid where t.key = 'input_error'").fetchall()
    rows = [r for r in rows if not r[0].startswith("racer")]  # the store's earlier runs
    assert sorted(rows) == [("a [reference]", "no golden"), ("b [reference]", "bad input"),
                            ("c [reference]", "no golden")]
    assert len(err_tag) == 1 and str(rollout) in err_tag[0][0]


def test_a_crash_outside_the_backends_is_the_scenarios_error(tmp_path, monkeypatch):
    scn = load_scenario(write_scenario(tmp_path / "boom.yaml"))

    def crash(scn, **kw):
        raise RuntimeError("disk on fire")
    monkeypatch.setattr(engine, "run_scenario", crash)
    res = run_isolated(scn, golden_dir=tmp_path / "golden")
    assert res.state == FAILED and res.backends == ["reference"]
    (c,) = res.checks
    assert c.status == "error" and "RuntimeError: disk on fire" in c.message
    assert "Traceback" in c.details["traceback"]
    assert json.loads(json.dumps(res.to_json()))["state"] == "failed"

    def bad(scn, **kw):
        raise InputError("expected a number", source="x.yaml", key="steps")
    monkeypatch.setattr(engine, "run_scenario", bad)
    res = run_isolated(scn, golden_dir=tmp_path / "golden")
    assert res.state == BAD_INPUT and "x.yaml: steps: expected a number" in res.input_error


def test_exit_code_of_an_invocation():
    def with_state(state):
        r = ScenarioResult("s", "s.yaml", ["reference"])
        if state == BAD_INPUT:
            r.input_error = "x"
        elif state == NO_GOLDEN_STATE:
            from rlaudit.verdict.result import GoldenResult
            r.golden = [GoldenResult("reference", "no golden")]
        elif state == FAILED:
            r.errors = {"reference": "crash"}
        else:  # a pass is a check that applied and passed (nothing applied is "n/a")
            from rlaudit.verdict.result import PASS, CheckResult
            r.checks = [CheckResult("backend-parity", "reference", PASS)]
        return r
    ok, none, failed, bad = (with_state(s) for s in ("passed", NO_GOLDEN_STATE, FAILED,
                                                      BAD_INPUT))
    assert exit_code([ok]) == 0 and exit_code([]) == 1
    assert exit_code([ok, none]) == 0 and exit_code([ok, none], require_golden=True) == 1
    assert exit_code([ok, failed]) == 1 and exit_code([failed, bad]) == 2
