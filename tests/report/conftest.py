"""Hand-built ScenarioResults (no model runs) and MLflow fixtures for the report tests.

The MLflow fixtures are session-scoped because they are slow on a 2-core box: a fresh sqlite store
runs ~50 alembic migrations (10-15 s), and `mlflow server` takes 30-90 s to start. Tests copy the
migrated template store instead of creating their own.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import torch

from rlaudit.backends.base import VariantRun
from rlaudit.verdict.result import CheckResult, GoldenResult, ScenarioResult

#: metric values every hand-built step starts from (step k adds 0.1 * k to each)
BASE_METRICS = {"actor/pg_loss": 0.5, "actor/entropy": 2.0, "actor/grad_norm": 1.5,
                "actor/ppo_kl": 0.0, "timing/step": 0.25}
RTOL, ATOL = 1e-6, 1e-9
SERVER_START_TIMEOUT_S = 240  # a loaded 2-core CI box has been seen to need ~90 s


def step_metrics(steps: int, *, shift: dict[str, float] | None = None) -> list[dict[str, float]]:
    """``shift``: metric -> amount added at every step (a metric not in BASE_METRICS is added
    with that value)."""
    shift = shift or {}
    extra = {k: v for k, v in shift.items() if k not in BASE_METRICS}
    return [{**{k: v + 0.1 * s + shift.get(k, 0.0) for k, v in BASE_METRICS.items()}, **extra}
            for s in range(steps)]


def golden_rows(obtained: list[dict[str, float]], golden: list[dict[str, float]]) -> list[dict]:
    rows = []
    for step, (got, want) in enumerate(zip(obtained, golden)):
        for name in sorted(want):
            if name.startswith("timing/"):
                continue
            v, g = got[name], want[name]
            rows.append({"metric": name, "step": step, "value": v, "golden": g, "rtol": RTOL,
                         "atol": ATOL, "drift": abs(v - g) / max(abs(g), 1e-12),
                         "ok": abs(v - g) <= ATOL + RTOL * abs(g)})
    return rows


def make_tokens(seed: int, *, offset: float = 0.0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"probe_log_probs": -torch.rand(2, 3, generator=g, dtype=torch.float64) + offset,
            "advantages": torch.randn(2, 3, generator=g, dtype=torch.float64)}


def make_result(scenario: str = "scn_a", *, backends=("reference", "fsdp"), steps: int = 2,
                shift: dict[str, dict[str, float]] | None = None, golden: bool = True,
                failing_check: bool = False, crashed: str | None = None) -> ScenarioResult:
    """``shift``: backend -> metric -> amount added to the obtained value (the golden stays the
    unshifted value, so a shift beyond the tolerance is a golden failure)."""
    shift = shift or {}
    res = ScenarioResult(scenario=scenario, path=f"scenarios/{scenario}.yaml",
                         backends=list(backends), config={"actor.entropy_coeff": 0.0,
                                                          "actor.loss_agg_mode": "token-mean",
                                                          "algorithm.adv_estimator": "grpo"},
                         layouts={b: ({"dp": 2} if b == "fsdp" else {}) for b in backends},
                         dtype="float64", device="cpu", tags=["seed"],
                         provenance={"rlaudit": "0.1.0", "torch": "2.13.0+cpu", "vllm": None,
                                     "model_sha": "abc123", "rollout_sha": "def456"},
                         seconds=1.5)
    for i, b in enumerate(backends):
        if b == crashed:
            res.errors[b] = "RankFailure: rank 1 died\nTraceback ...\nboom"
            res.checks.append(CheckResult("*", b, "error", "RankFailure: rank 1 died"))
            continue
        res.metrics[b] = step_metrics(steps, shift=shift.get(b))
        res.runs[b] = {"base": VariantRun("base", steps=res.metrics[b],
                                          tokens=make_tokens(7, offset=0.001 * i))}
        res.checks.append(CheckResult("entropy_logged", b, "pass"))
        res.checks.append(CheckResult("stored_kl_unaltered", b,
                                      "fail" if failing_check and b != "reference" else "pass",
                                      "rollout/kl 0.5 vs 0.25 <b>x</b>" if failing_check else ""))
        if golden:
            rows = golden_rows(res.metrics[b], step_metrics(steps))
            bad = [r for r in rows if not r["ok"]]
            res.golden.append(GoldenResult(b, "fail" if bad else "pass",
                                           f"{len(bad)} mismatch(es)" if bad else "", [],
                                           max(r["drift"] for r in rows), rows))
    res.checks.append(CheckResult("backend_parity", "*", "pass", drift=1e-7))
    return res


@pytest.fixture(scope="session")
def make():
    return make_result


# ---- MLflow -----------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def mlflow_db_template(tmp_path_factory) -> Path:
    """An empty sqlite store with MLflow's schema already migrated."""
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient
    path = tmp_path_factory.mktemp("mlflow_template") / "mlflow.db"
    MlflowClient(tracking_uri=f"sqlite:///{path}").search_experiments()
    return path


@pytest.fixture
def report_dir(tmp_path, mlflow_db_template) -> Path:
    """A report dir whose embedded store (reports/mlflow.db) is a copy of the migrated template."""
    d = tmp_path / "reports"
    d.mkdir()
    shutil.copy(mlflow_db_template, d / "mlflow.db")
    return d


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory, mlflow_db_template):
    """A real `mlflow server` on 127.0.0.1 (sqlite backend + artifact dir in a tmp dir); yields
    its URI and is killed (its whole process group) at the end of the session."""
    root = tmp_path_factory.mktemp("mlflow_server")
    shutil.copy(mlflow_db_template, root / "server.db")
    port = free_port()
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false", "OMP_NUM_THREADS": "1"}
    mlflow_cli = Path(sys.executable).with_name("mlflow")
    log = open(root / "server.log", "wb")
    proc = subprocess.Popen([str(mlflow_cli), "server", "--backend-store-uri",
                             f"sqlite:///{root / 'server.db'}", "--artifacts-destination",
                             str(root / "artifacts"), "--host", "127.0.0.1", "--port", str(port),
                             "--workers", "1"], stdout=log, stderr=subprocess.STDOUT, env=env,
                            start_new_session=True)
    uri = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + SERVER_START_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                tail = (root / "server.log").read_text()[-2000:]
                raise RuntimeError(f"mlflow server exited: {tail}")
            try:
                with urllib.request.urlopen(f"{uri}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                tail = (root / "server.log").read_text()[-2000:]
                raise RuntimeError(f"mlflow server did not start in {SERVER_START_TIMEOUT_S}s: "
                                   f"{tail}")
            time.sleep(0.5)
        yield uri
    finally:
        try:
            os.killpg(proc.pid, 15)
            proc.wait(timeout=20)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            try:
                os.killpg(proc.pid, 9)
            except ProcessLookupError:
                pass
        log.close()
