"""An invocation a Ctrl-C stopped is never recorded as passed: ``run`` exits 130 and its MLflow
parent run ends KILLED, tagged ``rlaudit.passed=false`` and ``rlaudit.interrupted=true``, with
the unfinished scenario's state "interrupted" (the finished one keeps its own)."""

from __future__ import annotations

import pytest
from reltools import write_scenario

from rlaudit.errors import EXIT_INTERRUPTED


@pytest.mark.slow  # opens (and migrates) an MLflow sqlite store
def test_an_interrupted_run_is_killed_and_not_passed_in_mlflow(cli, tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    import rlaudit.scenarios.outcome as outcome

    first = write_scenario(tmp_path / "first.yaml")
    second = write_scenario(tmp_path / "second.yaml")
    original = outcome.run_isolated

    def ctrl_c_in_second(scn, **kw):
        if scn.name == "second":
            raise KeyboardInterrupt
        return original(scn, **kw)

    monkeypatch.setattr(outcome, "run_isolated", ctrl_c_in_second)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    res = cli("run", first, second, "--golden-dir", tmp_path / "golden", "--report-dir",
              tmp_path / "reports", "--tracking-uri", uri, "--executor", "local")
    assert res.rc == EXIT_INTERRUPTED, res.err[-2000:]

    from mlflow.tracking import MlflowClient
    client = MlflowClient(tracking_uri=uri)
    runs = [r for e in client.search_experiments() for r in client.search_runs([e.experiment_id])
            if r.data.tags.get("rlaudit.interrupted") is not None]
    assert len(runs) == 1, runs
    parent = runs[0]
    assert parent.info.status == "KILLED"
    assert parent.data.tags["rlaudit.passed"] == "false"
    assert parent.data.tags["rlaudit.interrupted"] == "true"
    states = dict(s.split("=") for s in parent.data.tags["rlaudit.states"].split(","))
    assert states["second"] == "interrupted" and states["first"] != "interrupted"
