"""`rlaudit run` starts the ranks' forkserver early only when some scenario will fork CPU ranks
(rlaudit.cli.run._forks_ranks reads the scenario files' backends and device)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from rlaudit.cli.run import _forks_ranks


def _scenario(tmp_path, name, **spec):
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


@pytest.mark.parametrize("spec, backends, device, expected", [
    ({"backends": {"reference": {}, "fsdp": {"dp": 2}}}, None, None, True),
    ({"backends": {"reference": {}}}, None, None, False),
    ({"backends": {"reference": {}, "fsdp": {"dp": 2}}}, ["reference"], None, False),
    ({"backends": {"reference": {}, "megatron": {"tp": 2}}}, ["reference", "megatron"], None,
     True),
    ({"backends": {"fsdp": {}}, "device": "cuda"}, None, None, False),
    ({"backends": {"fsdp": {}}, "device": "cuda"}, None, "cpu", True),
    ({"backends": {"fsdp": {}}}, None, "cuda", False),
])
def test_forks_ranks_only_for_multi_rank_backends_on_cpu(tmp_path, spec, backends, device,
                                                         expected):
    assert _forks_ranks(_scenario(tmp_path, "s", **spec), backends, device) is expected


def test_an_unreadable_scenario_is_left_to_validation(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("backends: [unclosed")
    assert _forks_ranks(bad, None, None) is False
    assert _forks_ranks(tmp_path / "missing.yaml", None, None) is False


def _processes_with(marker: str) -> list[int]:
    import os

    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if marker.encode() in f.read():
                    found.append(int(pid))
        except OSError:
            pass
    return found


@pytest.mark.slow
def test_run_leaves_no_forkserver_or_rank_behind(tmp_path):
    """Everything `rlaudit run` started for its ranks (the forkserver, the forked ranks) is gone
    when it exits -- also when it exits early on bad input."""
    import os
    import subprocess
    import sys
    import time

    marker = f"RLAUDIT_TEST_MARK_{os.getpid()}_{time.monotonic_ns()}"
    env = {**os.environ, marker: "1"}
    env.pop("RLAUDIT_START_METHOD", None)
    cli = [sys.executable, "-m", "rlaudit.cli.main", "run", "--report-dir", str(tmp_path),
           "--no-mlflow"]
    good = subprocess.run([*cli, "seed_stored_kl", "--backend", "fsdp"], env=env,
                          capture_output=True, text=True, timeout=600)
    assert good.returncode == 0, good.stderr[-2000:]
    assert _processes_with(marker) == []
    repo = Path(__file__).resolve().parents[2]
    spec = yaml.safe_load((repo / "scenarios" / "seed_stored_kl.yaml").read_text())
    for key in ("model", "ref_model"):
        spec[key] = str(repo / "scenarios" / spec[key])
    spec["rollout"] = str(repo / "scenarios" / spec["rollout"])
    spec["config"].setdefault("actor", {})["no_such_key"] = 1  # found by validation
    broken = _scenario(tmp_path, "broken", **spec)
    bad = subprocess.run([*cli, str(broken)], env=env, capture_output=True, text=True,
                         timeout=600)
    assert bad.returncode == 2 and "no_such_key" in bad.stderr, bad.stderr[-2000:]
    assert _processes_with(marker) == []


def _pid(info):
    import os

    return os.getpid()


@pytest.mark.slow
def test_an_in_process_run_leaves_the_callers_pools_working(tmp_path, monkeypatch):
    """`rlaudit run` called in-process (a test session, a notebook) while the caller has warm
    pools up must not stop the forkserver those ranks came from: through it their exit status
    travels, so they would read as dead."""
    import time
    import warnings

    from rlaudit.backends.launch import RankTeardownWarning
    from rlaudit.backends.launch.pool import RankPool
    from rlaudit.cli.main import main

    monkeypatch.delenv("RLAUDIT_START_METHOD", raising=False)
    pool = RankPool(2)
    try:
        before = pool.run(_pid)
        assert main(["run", "seed_stored_kl", "--backend", "fsdp", "--no-mlflow",
                     "--report-dir", str(tmp_path)]) == 0
        time.sleep(1.5)
        with warnings.catch_warnings():  # a forkserver gone shows as ranks "dead" (exit 255)
            warnings.simplefilter("error", RankTeardownWarning)  # after their next result
            assert pool.run(_pid) == before  # the same ranks, still serving ...
            assert pool.run(_pid) == before and pool.spawned == 1  # ... and not respawned
    finally:
        pool.close()
