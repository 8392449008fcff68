"""A run stops when asked, and on time: one Ctrl-C (a real SIGINT to a real ``rlaudit`` process)
stops the replay running -- in the CLI's own process or on a warm pool's ranks -- within
seconds, with the stopped scenarios "interrupted" (never passed) in the table, the JSON and the
report, no rank left behind and nothing half-written; ``--timeout`` stops a scenario whose
replay would run for hours (``steps: 9999``) at the limit, naming the scenario and the limit.

Each case is a process of its own (stop_driver.py, the ``rlaudit`` entry point), bounded by
``communicate(timeout=...)``: a stop that does not happen fails the test instead of hanging it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from reltools import REPO, write_scenario

from rlaudit.errors import EXIT_CHECK_FAILED, EXIT_INTERRUPTED

DRIVER = Path(__file__).with_name("stop_driver.py")
#: seconds from the SIGINT to the process's exit that count as "within seconds" (measured:
#: 0.2 s with the replay in-process, 0.4 s with it on a warm pool's two ranks)
STOP_BOUND_S = 5.0
#: how long a case may take at all before it counts as hung
HUNG_S = 120.0
#: a replay that would run for hours: 9999 optimizer steps (the tiny model: ~0.1-1 s each)
FOREVER = 9999


def start(tmp: Path, *argv) -> tuple[subprocess.Popen, Path]:
    flag = tmp / "started"
    cmd = [sys.executable, str(DRIVER), str(flag), *map(str, argv),
           "--golden-dir", str(tmp / "golden"), "--report-dir", str(tmp / "reports"),
           "--no-mlflow"]
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO), str(DRIVER.parent),
                                          os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen(cmd, cwd=tmp, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    return proc, flag


def wait_started(proc: subprocess.Popen, flag: Path) -> None:
    deadline = time.monotonic() + HUNG_S
    while not flag.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            out, err = proc.communicate()
            pytest.fail(f"no replay started (rc {proc.returncode}): {err[-2000:]}")
        time.sleep(0.05)
    time.sleep(1.0)  # well inside the replay


def ctrl_c(proc: subprocess.Popen) -> tuple[float, str, str]:
    """SIGINT, then (seconds until the process exited, stdout, stderr)."""
    descendants = psutil.Process(proc.pid).children(recursive=True)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGINT)
    try:
        out, err = proc.communicate(timeout=HUNG_S)
    except subprocess.TimeoutExpired:
        for p in [psutil.Process(proc.pid), *descendants]:
            p.kill()
        out, err = proc.communicate()
        pytest.fail(f"one Ctrl-C did not stop the run within {HUNG_S:g} s: {err[-2000:]}")
    seconds = time.monotonic() - t0
    time.sleep(0.5)  # reaping
    left = [p.pid for p in descendants if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not left, f"processes left running after the Ctrl-C: {left}"
    return seconds, out, err


def no_partial_files(tmp: Path) -> None:
    """Nothing half-written: no temporary file left beside a golden or a report."""
    leftovers = [p for p in tmp.rglob("*") if p.is_file()
                 and (".tmp" in p.name or p.name.startswith("."))]
    assert not leftovers, leftovers


@pytest.mark.slow  # two CLI processes' start-up (~5 s each on 2 cores)
def test_one_ctrl_c_stops_an_in_process_replay_within_seconds(tmp_path):
    forever = write_scenario(tmp_path / "forever.yaml", steps=FOREVER)
    quick = write_scenario(tmp_path / "quick.yaml")
    proc, flag = start(tmp_path, "run", forever, quick, "--json")
    wait_started(proc, flag)
    seconds, out, err = ctrl_c(proc)
    assert proc.returncode == EXIT_INTERRUPTED, err[-2000:]
    assert seconds < STOP_BOUND_S, f"stopped {seconds:.1f} s after the Ctrl-C"
    results = {r["scenario"]: r for r in json.loads(out)}
    assert results["forever"]["state"] == "interrupted"
    assert results["forever"]["passed"] is False
    report = (tmp_path / "reports" / "latest" / "report.md").read_text()
    assert "forever: INTERRUPTED" in report, report[:2000]
    assert "interrupted" in err
    assert "Traceback" not in err, err[-3000:]
    no_partial_files(tmp_path)


@pytest.mark.slow  # a warm pool of two ranks and a one-rank reference pool (~20 s)
def test_one_ctrl_c_stops_ranks_mid_task_and_leaves_none(tmp_path):
    scn = write_scenario(tmp_path / "ranks.yaml", steps=FOREVER,
                         backends={"reference": {}, "fsdp": {"dp": 2}})
    proc, flag = start(tmp_path, "run", scn)
    wait_started(proc, flag)
    seconds, out, err = ctrl_c(proc)   # also: no rank (nor forkserver) outlives the run
    assert proc.returncode == EXIT_INTERRUPTED, err[-2000:]
    assert seconds < STOP_BOUND_S, f"stopped {seconds:.1f} s after the Ctrl-C"
    assert "ranks: INTERRUPTED" in out, out
    assert "0/1 scenarios passed (1 interrupted)" in out, out
    no_partial_files(tmp_path)


def run_to_limit(tmp_path, scn: Path, limit: float) -> tuple[float, str, str]:
    proc, _ = start(tmp_path, "run", scn, "--timeout", limit)
    t0 = time.monotonic()
    try:
        out, err = proc.communicate(timeout=HUNG_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"--timeout {limit} did not stop a {FOREVER}-step replay: {err[-2000:]}")
    seconds = time.monotonic() - t0
    assert proc.returncode == EXIT_CHECK_FAILED, err[-2000:]
    return seconds, out, err


@pytest.mark.slow  # runs until its --timeout
def test_timeout_stops_an_in_process_replay_at_the_limit(tmp_path):
    limit = 8
    scn = write_scenario(tmp_path / "forever.yaml", steps=FOREVER)
    seconds, out, err = run_to_limit(tmp_path, scn, limit)
    assert f"scenario forever did not finish within its time limit of {limit} s" in out, out
    # the limit counts from the scenario's start; the command's own start-up comes on top
    assert seconds < limit + 30, seconds
    assert "FAILED forever" in out
    no_partial_files(tmp_path)


@pytest.mark.slow  # a warm pool's start-up, then its --timeout
def test_timeout_stops_ranks_at_the_limit(tmp_path):
    limit = 8
    scn = write_scenario(tmp_path / "ranks.yaml", steps=FOREVER,
                         backends={"reference": {}, "fsdp": {"dp": 2}})
    seconds, out, err = run_to_limit(tmp_path, scn, limit)
    assert f"scenario ranks did not finish within its time limit of {limit} s" in out, out
    assert seconds < limit + 45, seconds   # the pools' start-up comes on top
    assert "FAILED ranks" in out
    no_partial_files(tmp_path)
