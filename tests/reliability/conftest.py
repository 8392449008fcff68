"""The reliability suite (issue #13): bad input, degenerate data, faults and concurrency, each
driven through the ``rlaudit`` command (``rlaudit.cli.main.main`` in-process, like tests/cli) and
checked for its exit code, its message (file and key) and that no golden changed.

Every scenario here is the cheapest there is: the tiny committed model and rollout, one step,
the reference backend, sanity-bounds, --no-mlflow unless MLflow is the point. Helpers: reltools.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import pytest
from reltools import GOLDEN, tree_digest

from rlaudit.cli.main import main


@pytest.fixture(autouse=True)
def committed_goldens_unchanged():
    """Whatever a test does, the committed golden/ directory stays byte-identical."""
    before = tree_digest(GOLDEN)
    yield
    assert tree_digest(GOLDEN) == before, "a test changed the committed golden/ directory"


@dataclass
class Outcome:
    rc: int
    out: str
    err: str
    seconds: float


@pytest.fixture
def cli(capsys):
    """``cli(*argv) -> Outcome``: the rlaudit command in-process (argv parsing, exit code)."""
    def run(*argv) -> Outcome:
        t0 = time.perf_counter()
        try:
            rc = main([str(a) for a in argv])
        except SystemExit as e:  # argparse usage errors
            rc = int(e.code)
        out, err = capsys.readouterr()
        return Outcome(rc, out, err, time.perf_counter() - t0)
    return run


#: what each racing `rlaudit run` executes: the real CLI, held at a barrier just before it opens
#: the MLflow store, so that both first runs reach a fresh store at the same moment
RACER = """
import sys, time
from pathlib import Path
import rlaudit.report.mlflow_guard as guard
ready, go = Path(sys.argv[1]), Path(sys.argv[2])
original = guard.open_store_lock
def held(uri):
    ready.touch()
    deadline = time.monotonic() + 600
    while not go.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    return original(uri)
guard.open_store_lock = held
from rlaudit.cli.main import main
sys.exit(main(sys.argv[3:]))
"""


@pytest.fixture(scope="session")
def first_runs(tmp_path_factory):
    """Issue case 5: two first-ever `rlaudit run` invocations racing on one fresh embedded
    sqlite store (default location <report dir>/mlflow.db). Returns (processes' (rc, stderr),
    the store's path); the store, migrated once here, is reused by other tests."""
    import os
    import subprocess
    import sys
    from reltools import REPO, write_scenario
    root = tmp_path_factory.mktemp("first_runs")
    reports = root / "reports"
    go = root / "go"
    procs = []
    for i in range(2):
        scn = write_scenario(root / f"racer{i}.yaml")
        cmd = [sys.executable, "-c", RACER, str(root / f"ready{i}"), str(go), "run", str(scn),
               "--golden-dir", str(root / "golden"), "--report-dir", str(reports)]
        env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
               "OMP_NUM_THREADS": "1"}
        env.pop("MLFLOW_TRACKING_URI", None)
        procs.append(subprocess.Popen(cmd, cwd=root, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    deadline = time.monotonic() + 600
    while not all((root / f"ready{i}").exists() for i in range(2)):
        if any(p.poll() is not None for p in procs) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    go.touch()
    out = []
    for p in procs:
        _, err = p.communicate(timeout=900)
        out.append((p.returncode, err))
    return out, reports / "mlflow.db"
