"""``--executor ray`` against the local executor on a local Ray cluster (CPU): the same scenario
gives the same metrics (bit for bit), checks, golden comparisons and MLflow metrics; a rank that
raises and a worker that dies on Ray are reported like failed ranks, and the next task gets a
fresh group.

Both executors run in one driver process (tests/executors/ray_driver.py), the local one first,
before Ray starts: the same thread count for the reference replay, as a user's two invocations
would have. One cheap scenario: seed_stored_kl on the reference and FSDP
dp=2 (two variants; Megatron's layouts go through the same rank groups, see test_pool.py for
their isolation).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent

pytestmark = pytest.mark.slow


def _env() -> dict:
    return dict(os.environ, RAY_USAGE_STATS_ENABLED="0",
                PYTHONPATH=os.pathsep.join([str(REPO), str(HERE),
                                            os.environ.get("PYTHONPATH", "")]))


def _untimed(metrics: dict) -> dict:
    return {b: [{k: v for k, v in step.items() if not k.startswith("timing/")} for step in steps]
            for b, steps in metrics.items()}


def _mlflow_metrics(uri: str) -> dict:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    out = {}
    for exp in client.search_experiments():
        for run in client.search_runs([exp.experiment_id]):
            name = run.data.tags.get("mlflow.runName", "")
            if "seed_stored_kl" in name:
                out[name] = {k: v for k, v in run.data.metrics.items()
                             if not k.startswith("timing")}
    return out


def test_ray_executor_matches_local_and_reports_failed_ranks(tmp_path):
    pytest.importorskip("ray")
    pytest.importorskip("mlflow")
    local_dir, ray_dir = tmp_path / "local", tmp_path / "ray"
    local_uri, ray_uri = (f"sqlite:///{tmp_path / n}.db" for n in ("local", "ray"))
    local_dir.mkdir()
    ray_dir.mkdir()
    driver = subprocess.run([sys.executable, str(HERE / "ray_driver.py"), str(local_dir),
                             local_uri, str(ray_dir), ray_uri],
                            cwd=REPO, env=_env(), capture_output=True, text=True, timeout=900)
    assert driver.returncode == 0, driver.stderr[-3000:]
    seen = json.loads(driver.stdout.strip().splitlines()[-1])

    # the same results
    (want,), (got,) = (json.loads((d / "results.json").read_text()) for d in (local_dir, ray_dir))
    assert seen["local_rc"] == 0 and seen["rc"] == 0 and got["passed"] and want["passed"]
    # every backend, step and metric, bit for bit (timings aside)
    assert _untimed(got["metrics"]) == _untimed(want["metrics"])
    assert got["checks"] == want["checks"]
    assert got["golden"] == want["golden"]
    drop = ("seconds", "metrics")
    assert {k: v for k, v in got.items() if k not in drop} == \
        {k: v for k, v in want.items() if k not in drop}
    for d in (local_dir, ray_dir):
        assert (d / "latest" / "report.html").is_file()
        assert "Transformer Engine" not in (d / "latest" / "report.html").read_text()
    assert "WARNING" not in driver.stderr and "Transformer Engine" not in driver.stderr
    assert _mlflow_metrics(ray_uri) == _mlflow_metrics(local_uri) != {}

    # failures on Ray groups
    assert seen["ok"] == [6.0, 6.0] and seen["after"] == [3.0, 3.0]
    assert "rank 1 raised ValueError: injected failure in rank 1" in seen["raise"]
    assert 'ray_driver.py", line' in seen["raise"]  # the rank's traceback, from Ray
    assert seen["fresh"]                            # after a failure: other processes
    assert "rank 1" in seen["die"] and "died" in seen["die"]
    assert seen["stats"]["failed"] == 2 and seen["stats"]["spawned"] == 2
