"""Tests of the multi-rank launcher (rlaudit.backends.launch).

The rank functions are module-level (every rank imports them: spawned, or forked from the
forkserver). Starting a few ranks costs seconds on 2 cores, so every launching test checks several
things in one launch.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from rlaudit.backends.launch import RESERVED_ENV, RankTeardownWarning, launch
from rlaudit.backends.launch import rank_group as launch_group
from rlaudit.backends.launch.common import RankFiles, write_atomic
from rlaudit.backends.launch.outcomes import (RankOutcome, describe_exitcode, failure_message,
                                              order_outcomes, read_tail)
from rlaudit.errors import InputError, RankFailure

# ----------------------------------------------------------------------------- rank functions


def _report_everything(info, scale):
    """all_reduce of (rank+1)*scale in float64, env, threads, shared scratch, a child process."""
    x = torch.full((3,), float(info.rank + 1), dtype=torch.float64) * scale
    dist.all_reduce(x)
    if info.rank == 0:
        (info.tmpdir / "from_rank0.txt").write_text("hello")
    dist.barrier()
    sleeper = subprocess.Popen(["sleep", "120"])  # must not outlive the launch
    if info.rank == 1:
        dist.barrier = _exit_9  # the rank's teardown barrier, after its result is saved, crashes
    env = {k: os.environ.get(k) for k in (*RESERVED_ENV, "RLAUDIT_TEST_VAR")}
    return {"sum": x, "list": [info.rank, "a", 2.5], "info": (info.rank, info.world_size,
            info.local_rank, str(info.device), info.backend, str(info.tmpdir)),
            "env": env, "threads": torch.get_num_threads(), "sleeper": sleeper.pid,
            "scratch": (info.tmpdir / "from_rank0.txt").read_text(),
            "dist_world": dist.get_world_size()}


def _sum_ranks(info, scale):
    x = torch.tensor([float(info.rank + 1) * scale], dtype=torch.float64)
    for _ in range(5):  # several collectives, so that crossed groups would show up
        y = x.clone()
        dist.all_reduce(y)
    return (info.rank, info.world_size, y)


def _raise_in_loop(info):
    """Ranks 0 and 1 all_reduce in a loop until rank 1 raises; rank 2 is busy elsewhere."""
    pair = dist.new_group([0, 1])
    if info.rank == 2:
        _stuck_forever()
    x = torch.ones(4)
    for step in range(10_000):
        if info.rank == 1 and step == 3:
            print("about to fail on rank 1", flush=True)
            raise ValueError(f"boom at step {step}")
        dist.all_reduce(x, group=pair)  # rank 0 reaches step 3's all_reduce, waits for rank 1
    return "unreachable"


def _die_in_various_ways(info):
    dist.barrier()  # every rank is past init ...
    time.sleep(0.5)  # ... and out of the barrier: the failures below happen together, alone
    if info.rank == 0:
        os._exit(7)
    if info.rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    if info.rank == 2:
        ctypes.string_at(0)  # segfault
    if info.rank == 3:
        return lambda: None  # a result that cannot be pickled
    os._exit(0)  # rank 4: a clean exit code, but no result


def _stuck_forever():
    while True:
        time.sleep(0.05)


def _rank1_hangs(info):
    if info.rank == 1:
        _stuck_forever()
    return "rank0 done"


def _exit_9(*args, **kwargs):
    os._exit(9)


def _write_pid_then_hang(info, path):
    Path(path + ".tmp").write_text(str(os.getpid()))
    os.replace(path + ".tmp", path)
    _stuck_forever()


def _parent_pid(info, wait=0.0):
    time.sleep(wait)
    return os.getppid()


def _environment(info=None):
    """This process's environment, less what the launcher sets in every rank and what torch's
    inductor sets when something imports it (the forkserver's preload does; so would any rank
    importing those modules)."""
    return {k: v for k, v in os.environ.items()
            if k not in (*RESERVED_ENV, "TORCHINDUCTOR_CACHE_DIR")
            and not k.startswith(("GLOO_", "NCCL_"))}


def _cuda_all_reduce(info):
    x = torch.full((2,), float(info.rank + 1), device=info.device)
    dist.all_reduce(x)
    return {"x": x, "device": str(info.device), "current": torch.cuda.current_device(),
            "backend": info.backend}


def _returns_none(info):
    return None


# ----------------------------------------------------------------------------- helpers


def _alive(pid: int) -> bool:
    """True when ``pid`` is a live (non-zombie) process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _no_rank_processes_left() -> bool:
    import multiprocessing as mp

    return not [p for p in mp.active_children() if p.name.startswith("rlaudit-rank")]


# ----------------------------------------------------------------------------- argument checks


def test_rejects_functions_spawn_cannot_import():
    def local_fn(info):
        return 1

    for fn in (lambda info: 1, local_fn):
        with pytest.raises(InputError, match="module level") as err:
            launch(fn, 1)
        assert err.value.key == "fn"


@pytest.mark.parametrize("kwargs, key", [
    ({"world_size": 0}, "world_size"), ({"world_size": True}, "world_size"),
    ({"world_size": 2.0}, "world_size"), ({"device": "tpu"}, "device"),
    ({"backend": "mpi"}, "backend"), ({"backend": "nccl"}, "backend"),
    ({"timeout": 0}, "timeout"), ({"threads_per_rank": 0}, "threads_per_rank"),
    ({"env": {"RANK": "3"}}, "env.RANK"),
    ({"env": {"OMP_NUM_THREADS": "4"}}, "env.OMP_NUM_THREADS"),
    ({"env": {"X": 1}}, "env"), ({"args": (threading.Lock(),)}, "args"),
    ({"kwargs": {"lock": threading.Lock()}}, "kwargs"), ({"args": 5}, "args"),
])
def test_rejects_bad_arguments_naming_them(kwargs, key):
    kwargs = {"world_size": 1, **kwargs}
    with pytest.raises(InputError) as err:
        launch(_returns_none, kwargs.pop("world_size"), **kwargs)
    assert err.value.key == key
    assert "launch()" in str(err.value)


# ----------------------------------------------------------------------------- pure helpers


def test_write_atomic_leaves_nothing_when_the_writer_fails(tmp_path):
    target = tmp_path / "r.pt"

    def half_then_fail(f):
        f.write(b"partial")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError):
        write_atomic(target, half_then_fail)
    assert list(tmp_path.iterdir()) == []
    write_atomic(target, lambda f: f.write(b"complete"))
    assert target.read_bytes() == b"complete"
    assert list(tmp_path.iterdir()) == [target]


def test_read_tail_keeps_the_last_lines_and_chars(tmp_path):
    log = tmp_path / "rank0.log"
    log.write_text("".join(f"line {i}\n" for i in range(100)))
    assert read_tail(log, 3) == "line 97\nline 98\nline 99"
    assert read_tail(log, 3, max_chars=7) == "...\nline 99"
    assert read_tail(tmp_path / "missing.log") == ""


def test_describe_exitcode():
    assert describe_exitcode(7) == "died with exit code 7"
    assert describe_exitcode(-9) == "was killed by signal SIGKILL (9)"
    assert describe_exitcode(-11) == "was killed by signal SIGSEGV (11)"
    assert "without returning a result" in describe_exitcode(0)


def test_outcomes_are_ordered_causes_first():
    echo = RankOutcome(0, "raised", when=1.0, exc_type="builtins.RuntimeError",
                       message="Connection reset by peer", phase="fn", peer_lost=True)
    died = RankOutcome(3, "died", when=2.0, exitcode=-9)
    raised = RankOutcome(1, "raised", when=3.0, exc_type="builtins.ValueError", message="boom",
                         phase="fn", traceback="Traceback ...\nValueError: boom\n")
    killed = RankOutcome(2, "terminated", when=0.5, phase="fn", stacks="File x.py, line 3 in wait")
    assert [o.rank for o in order_outcomes([echo, died, raised, killed])] == [3, 1, 0, 2]

    text = failure_message([echo, raised, killed, died], fn_name="m.f", world_size=4, timeout=9,
                           startup_timeout=60)
    assert text.startswith("rank 3 of 4 failed running m.f: was killed by signal SIGKILL (9)")
    summary = text.split("\n\n")[0].splitlines()[2:]
    assert summary == ["  rank 3 was killed by signal SIGKILL (9)",
                       "  rank 1 raised ValueError: boom (phase: fn)",
                       "  rank 0 raised RuntimeError: Connection reset by peer (phase: fn) -- "
                       "likely a consequence of another rank leaving the collective",
                       "  rank 2 was still running fn and was terminated by the launcher"]
    assert "ValueError: boom" in text and "File x.py, line 3 in wait" in text

    stuck = RankOutcome(1, "timeout", when=5.0, phase="fn", stacks="in _stuck_forever")
    text = failure_message([stuck], fn_name="m.f", world_size=2, timeout=12, startup_timeout=60)
    assert text.startswith("timed out after 12 s running m.f on 2 ranks; ranks not finished: 1\n")
    assert "rank 1 was still running fn at the deadline and was killed" in text
    starting = [RankOutcome(r, "timeout", when=5.0, phase="startup") for r in (1, 0)]
    text = failure_message(starting, fn_name="m.f", world_size=2, timeout=12, startup_timeout=60)
    assert text.startswith("timed out running m.f on 2 ranks; ranks not started within 60 s: 0, 1")


def test_rank_entry_point_does_not_import_torch():
    """A rank sets its environment (OMP_NUM_THREADS, NCCL_*, ...) before torch is imported, which
    only works while importing the spawn target leaves torch alone."""
    code = ("import sys, rlaudit.backends.launch.worker as w; "
            "print(sorted(m for m in ('torch', 'numpy') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_rank_files_are_distinct_per_rank(tmp_path):
    a, b = RankFiles.of(tmp_path, 0), RankFiles.of(tmp_path, 1)
    paths = {a.log, a.stacks, a.result, a.error, b.log, b.stacks, b.result, b.error}
    assert len(paths) == 8 and all(p.parent == tmp_path for p in paths)


# ----------------------------------------------------------------------------- spawning tests


@pytest.mark.slow
def test_two_ranks_return_results_even_if_one_crashes_after_them():
    with pytest.warns(RankTeardownWarning, match="rank 1 died with exit code 9 after its result"):
        out = launch(_report_everything, 2, args=(10.0,), env={"RLAUDIT_TEST_VAR": "yes"},
                     threads_per_rank=2)
    assert len(out) == 2
    expected_sum = torch.full((3,), (1 + 2) * 10.0, dtype=torch.float64)
    ports = set()
    for rank, r in enumerate(out):
        torch.testing.assert_close(r["sum"], expected_sum, rtol=0, atol=0)
        assert r["sum"].dtype == torch.float64 and r["sum"].device.type == "cpu"
        assert r["list"] == [rank, "a", 2.5]
        assert r["info"][:5] == (rank, 2, rank, "cpu", "gloo")
        assert r["dist_world"] == 2 and r["scratch"] == "hello"
        assert r["threads"] == 2
        env = r["env"]
        assert (env["RANK"], env["LOCAL_RANK"], env["WORLD_SIZE"]) == (str(rank), str(rank), "2")
        assert env["MASTER_ADDR"] == "127.0.0.1" and env["OMP_NUM_THREADS"] == "2"
        assert env["RLAUDIT_TEST_VAR"] == "yes"
        ports.add(env["MASTER_PORT"])
    assert len(ports) == 1 and ports.pop().isdigit()
    assert out[0]["info"][5] == out[1]["info"][5]  # one scratch folder shared by the ranks ...
    assert not Path(out[0]["info"][5]).exists()  # ... removed afterwards
    time.sleep(0.2)  # init reaps the orphaned sleepers
    assert not any(_alive(r["sleeper"]) for r in out), "a rank's child outlived the launch"
    assert _no_rank_processes_left()


@pytest.mark.slow
def test_rank_raising_inside_collectives_is_reported_with_its_traceback():
    with pytest.raises(RankFailure) as err:
        launch(_raise_in_loop, 3, timeout=120)
    reported_at = time.time()
    text = str(err.value)
    assert text.startswith("rank 1 of 3 failed running test_launch._raise_in_loop") or \
        text.startswith("rank 1 of 3 failed running tests.backends.test_launch._raise_in_loop")
    assert "ValueError: boom at step 3" in text
    assert 'in _raise_in_loop\n    raise ValueError(f"boom at step {step}")' in text  # remote tb
    assert "about to fail on rank 1" in text  # the rank's own output, from its log
    first, second, third = err.value.outcomes
    assert (first.rank, first.kind, first.phase) == (1, "raised", "fn")
    assert first.exc_type == "builtins.ValueError" and first.message == "boom at step 3"
    # the failure is reported promptly, however long spawning took (time from the raise)
    assert reported_at - first.when < 20, f"reported {reported_at - first.when:.1f} s after"
    # rank 0 was waiting in all_reduce: it saw its peer vanish, or was killed; never first
    assert second.rank == 0 and (second.kind == "terminated" or second.peer_lost)
    # rank 2 was busy outside any collective: killed, with its stack showing where it was
    assert (third.rank, third.kind, third.phase) == (2, "terminated", "fn")
    assert "in _stuck_forever" in third.stacks and "in _raise_in_loop" in third.stacks
    assert "rank 2 was still running fn and was terminated by the launcher" in text
    assert err.value.exit_code == 1
    assert _no_rank_processes_left()


@pytest.mark.slow
def test_hard_deaths_and_unreturnable_results_are_reported():
    with pytest.raises(RankFailure) as err:
        launch(_die_in_various_ways, 5, timeout=120)
    text = str(err.value)
    by_rank = {o.rank: o for o in err.value.outcomes}
    assert sorted(by_rank) == [0, 1, 2, 3, 4]
    assert (by_rank[0].kind, by_rank[0].exitcode) == ("died", 7)
    assert "rank 0 died with exit code 7" in text
    assert (by_rank[1].kind, by_rank[1].exitcode) == ("died", -signal.SIGKILL)
    assert "rank 1 was killed by signal SIGKILL (9)" in text
    assert (by_rank[2].kind, by_rank[2].exitcode) == ("died", -signal.SIGSEGV)
    assert "Segmentation fault" in by_rank[2].log_tail  # faulthandler's dump ...
    assert "in _die_in_various_ways" in by_rank[2].log_tail  # ... with the Python stack
    assert (by_rank[3].kind, by_rank[3].phase) == ("raised", "result")
    assert (by_rank[4].kind, by_rank[4].exitcode) == ("died", 0)
    assert "rank 4 exited with code 0 without returning a result" in text
    assert _no_rank_processes_left()


@pytest.mark.slow
def test_timeout_names_the_stuck_rank_and_shows_its_stack():
    with pytest.raises(RankFailure) as err:
        launch(_rank1_hangs, 2, timeout=1.5)  # counted from when both ranks are ready
    text = str(err.value)
    assert text.startswith("timed out after 1.5 s running")
    assert "ranks not finished: 1\n" in text
    (stuck,) = err.value.outcomes  # rank 0 returned its result: not listed
    assert (stuck.rank, stuck.kind, stuck.phase) == (1, "timeout", "fn")
    assert "in _stuck_forever" in stuck.stacks and "in _rank1_hangs" in stuck.stacks
    assert _no_rank_processes_left()


def test_startup_has_its_own_deadline(monkeypatch):
    monkeypatch.setenv("RLAUDIT_START_METHOD", "spawn")  # a forked rank may be up in 0.3 s
    monkeypatch.setattr(launch_group, "STARTUP_TIMEOUT_S", 0.3)  # no rank imports torch that fast
    with pytest.raises(RankFailure) as err:
        launch(_returns_none, 1, timeout=60)
    assert "ranks not started within 0.3 s: 0" in str(err.value)
    (stuck,) = err.value.outcomes
    assert (stuck.rank, stuck.kind, stuck.phase) == (0, "timeout", "startup")
    assert _no_rank_processes_left()


@pytest.mark.slow
def test_concurrent_launches_do_not_collide_and_one_rank_works(recwarn):
    jobs = {"a": (2, 1.0), "b": (2, 100.0), "c": (1, 7.0)}
    results: dict[str, object] = {}

    def run(name, world_size, scale):
        try:
            results[name] = launch(_sum_ranks, world_size, args=(scale,), timeout=120)
        except BaseException as exc:  # noqa: BLE001 - reported by the assertion below
            results[name] = exc

    threads = [threading.Thread(target=run, args=(n, *job)) for n, job in jobs.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for name, (world_size, scale) in jobs.items():
        out = results[name]
        assert isinstance(out, list), f"launch {name} failed: {out}"
        expected = sum((r + 1) * scale for r in range(world_size))  # naive loop over ranks
        assert [(r, w) for r, w, _ in out] == [(r, world_size) for r in range(world_size)]
        assert all(y.item() == expected for _, _, y in out)
    assert not [w for w in recwarn if issubclass(w.category, RankTeardownWarning)]
    assert _no_rank_processes_left()


_START_METHODS = """
import json, os, sys, threading, time
import test_launch as t
from rlaudit.backends.launch import start, launch
out = {"launcher": os.getpid(), "forked": launch(t._parent_pid, 2, timeout=120),
       "server": start.forkserver_pid()}
out["env_same"] = launch(t._environment, 1, timeout=120) == [t._environment()]
out["with_env"] = launch(t._parent_pid, 1, env={"RLAUDIT_TEST_VAR": "x"}, timeout=120)
os.environ["RLAUDIT_TEST_VAR"] = "changed"
out["env_changed"] = launch(t._parent_pid, 1, timeout=120)
del os.environ["RLAUDIT_TEST_VAR"]
got = {}
slow = threading.Thread(target=lambda: got.update(r=launch(t._parent_pid, 1, args=(2.0,))))
slow.start()
import multiprocessing
while not multiprocessing.active_children():
    time.sleep(0.01)
start.stop_forkserver()  # a forked one-shot group runs: not now
out["server_during"] = start.forkserver_pid()
slow.join()
out["slow"] = got.get("r")
start.stop_forkserver()
out["server_after"] = start.forkserver_pid()
print(json.dumps(out))
"""


@pytest.mark.slow
def test_one_shot_ranks_fork_from_the_forkserver_when_they_see_what_spawned_ones_would():
    """Forked on CPU; spawned when the launch has an ``env`` (set before torch is imported) or
    the launcher's environment changed since the forkserver started; the forkserver is not
    stopped under a forked one-shot group. In a fresh process: the test session's forkserver
    started under whatever environment some earlier test had."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RLAUDIT_START_METHOD", "RLAUDIT_TEST_VAR")}
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(Path(__file__).parent), os.environ.get("PYTHONPATH")) if p)
    run = subprocess.run([sys.executable, "-c", _START_METHODS], env=env, capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    launcher, server = out["launcher"], out["server"]
    assert server is not None and server != launcher
    assert out["forked"] == [server, server]
    assert out["env_same"]  # the launcher's environment, as a spawned rank's would be
    assert out["with_env"] == [launcher] and out["env_changed"] == [launcher]
    assert out["slow"] == [server] and out["server_during"] == server
    assert out["server_after"] is None


_ONE_SHOT = "from rlaudit.backends.launch import launch; launch(t._write_pid_then_hang, 1, {})"
_LAUNCHERS = {  # (code, $RLAUDIT_START_METHOD)
    # a one-shot launch, spawned: the rank is the launcher's child
    "launch-spawned": (_ONE_SHOT, "spawn"),
    # a one-shot launch on CPU: the rank is forked from the launcher's forkserver, whose child it is
    "launch": (_ONE_SHOT, None),
    # a warm pool on CPU: forked from the forkserver too
    "pool": ("from rlaudit.backends.launch.pool import RankPool; "
             "RankPool(1).run(t._write_pid_then_hang, {})", None),
}


@pytest.mark.slow
@pytest.mark.parametrize("how", list(_LAUNCHERS))
def test_ranks_do_not_outlive_a_killed_launcher(tmp_path, how):
    pid_file = tmp_path / "rank.pid"
    code, method = _LAUNCHERS[how]
    code = "import test_launch as t; " + code.format(f"args=({str(pid_file)!r},)")
    env = {k: v for k, v in os.environ.items() if k != "RLAUDIT_START_METHOD"}
    if method:
        env["RLAUDIT_START_METHOD"] = method
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(Path(__file__).parent), os.environ.get("PYTHONPATH")) if p)
    launcher = subprocess.Popen([sys.executable, "-c", code], env=env)
    try:
        deadline = time.monotonic() + 240
        while not pid_file.exists():
            assert launcher.poll() is None, "the launcher ended before its rank started"
            assert time.monotonic() < deadline, "the rank never started"
            time.sleep(0.1)
        rank_pid = int(pid_file.read_text())
        assert _alive(rank_pid)
        parent = int(Path(f"/proc/{rank_pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        assert (parent == launcher.pid) == (how == "launch-spawned")  # else the forkserver
    finally:
        launcher.kill()
        launcher.wait()
    deadline = time.monotonic() + 10  # the rank's watchdog polls every second
    while _alive(rank_pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(rank_pid), "a rank outlived its launcher"


@pytest.mark.gpu
@pytest.mark.slow
def test_nccl_on_cuda():
    world_size = min(2, torch.cuda.device_count())
    out = launch(_cuda_all_reduce, world_size, device="cuda")
    expected = float(sum(r + 1 for r in range(world_size)))
    for rank, r in enumerate(out):
        assert r["x"].device.type == "cpu" and r["x"].tolist() == [expected, expected]
        assert (r["device"], r["current"], r["backend"]) == (f"cuda:{rank}", rank, "nccl")
