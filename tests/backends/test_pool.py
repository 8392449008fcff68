"""Warm rank pools (rlaudit.backends.launch.pool): ranks reused across tasks, state reset between
tasks, failures reported per task and the group respawned, and -- the point of the isolation --
replays whose results do not depend on what ran before them in the same pool (two orders,
compared bit for bit).

The rank functions are module-level (spawned ranks import them).
"""

from __future__ import annotations

import os
import random
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from rlaudit.backends.launch.pool import RankPool, register_task_reset, run_ranks, warm_pools
from rlaudit.errors import InputError, RankFailure

REPO = Path(__file__).resolve().parents[2]

# ----------------------------------------------------------------------------- rank functions


def _sum_ranks(info, scale):
    x = torch.tensor([float(info.rank + 1) * scale], dtype=torch.float64)
    dist.all_reduce(x)
    return {"pid": os.getpid(), "rank": info.rank, "sum": float(x), "tmpdir": str(info.tmpdir)}


_RESET_MARK = []


def _mark_reset():
    _RESET_MARK.append(True)


def _dirty(info):
    """Leave behind everything a task might: a sub-group, another default dtype, grad mode off,
    consumed/reseeded RNGs, deterministic mode, more threads, a registered reset."""
    before = torch.get_rng_state()
    register_task_reset(_mark_reset)
    group = dist.new_group([0, 1])
    dist.all_reduce(torch.ones(1), group=group)
    torch.set_default_dtype(torch.float64)
    torch.set_grad_enabled(False)
    torch.manual_seed(123)
    torch.rand(5)
    random.seed(7)
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(2)
    return {"rng": before, "py_rng": random.getstate()}


def _state(info):
    from torch.distributed.distributed_c10d import _world

    return {"rng": torch.get_rng_state(), "dtype": torch.get_default_dtype(),
            "grad": torch.is_grad_enabled(), "groups": len(_world.pg_map),
            "deterministic": torch.are_deterministic_algorithms_enabled(),
            "threads": torch.get_num_threads(), "reset_ran": bool(_RESET_MARK),
            "py_rng": random.getstate(), "pid": os.getpid()}


def _fail(info, mode):
    """Rank 1 fails while rank 0 waits in a collective for it (a rank that raises exits, as one
    that is killed does: the launcher's tests cover the kinds of death)."""
    if info.rank == 1:
        if mode == "raise":
            raise ValueError("injected failure in rank 1")
        time.sleep(60)  # mode == "hang"
    dist.all_reduce(torch.ones(1))
    return info.rank


class _SlowToFree:
    """Garbage that takes ``seconds`` to collect and says when it was collected."""

    def __init__(self, seconds):
        self.seconds, self.me = seconds, self  # a cycle: only gc.collect frees it

    def __del__(self):
        time.sleep(self.seconds)
        _FREED.append(time.time())


_FREED: list[float] = []
_HELD: list = []


def _leave_slow_garbage(info, seconds):
    """Garbage from the task's reset on (held until then: no automatic collection on the way)."""
    _HELD.append(_SlowToFree(seconds))
    register_task_reset(_HELD.clear)
    return time.time()


def _freed(info):
    return list(_FREED)


# ----------------------------------------------------------------------------- cheap tests


@pytest.mark.slow
def test_pool_reuses_its_ranks_and_resets_state_between_tasks():
    with warm_pools() as pools:
        first = run_ranks(_sum_ranks, 2, pool="t", args=(10.0,))
        second = run_ranks(_sum_ranks, 2, pool="t", args=(1.0,))
        dirty = run_ranks(_dirty, 2, pool="t")
        after = run_ranks(_state, 2, pool="t")
        assert pools.stats == {"pools": 1, "spawned": 1, "tasks": 4, "respawned": 0}
    # sums: (1 + 2) * scale, computed independently of the pool
    assert [r["sum"] for r in first] == [30.0, 30.0]
    assert [r["sum"] for r in second] == [3.0, 3.0]
    assert [r["rank"] for r in first] == [0, 1]
    assert [r["pid"] for r in first] == [r["pid"] for r in second] == [r["pid"] for r in after]
    assert first[0]["tmpdir"] != second[0]["tmpdir"]  # a scratch folder per task
    for d, a in zip(dirty, after):
        assert torch.equal(a["rng"], d["rng"])  # the RNG as it was when _dirty started
        assert a["py_rng"] != d["py_rng"]
        assert a["dtype"] == torch.float32 and a["grad"] and not a["deterministic"]
        assert a["groups"] == 1 and a["threads"] == 1 and a["reset_ran"]


@pytest.mark.slow
def test_a_task_is_answered_before_its_garbage_is_collected_and_the_next_finds_it_gone():
    """Collecting a task's garbage (0.1-0.2 s in a Megatron rank) is on no one's path: the
    answer comes first; the next task starts once it is done."""
    pool = RankPool(2)
    try:
        pool.run(_sum_ranks, args=(1.0,))  # warm
        ended = pool.run(_leave_slow_garbage, args=(2.0,))
        answered = time.time()
        freed = pool.run(_freed)
    finally:
        pool.close()
    for end, got in zip(ended, freed):
        # collected once, 2 s after the task ended (its finaliser), before the next task -- and
        # after the answer was back (a collection before answering would have held it up)
        assert len(got) == 1 and got[0] >= end + 2.0 and got[0] > answered


@pytest.mark.slow
def test_failed_task_is_reported_and_the_next_gets_a_fresh_group():
    pool = RankPool(2)
    try:
        ok = pool.run(_sum_ranks, args=(1.0,))
        with pytest.raises(RankFailure) as raised:
            pool.run(_fail, args=("raise",), timeout=120)
        text = str(raised.value)
        assert "rank 1" in text and "injected failure in rank 1" in text and "Traceback" in text
        assert text.index("rank 1 raised ValueError") < text.index("rank 0")  # cause first
        t0 = time.perf_counter()
        with pytest.raises(RankFailure) as hung:
            pool.run(_fail, args=("hang",), timeout=1.5)
        assert time.perf_counter() - t0 < 30
        assert "timed out after 1.5 s" in str(hung.value) and "Python stacks" in str(hung.value)
        again = pool.run(_sum_ranks, args=(2.0,))
        assert [r["sum"] for r in again] == [6.0, 6.0]
        assert {r["pid"] for r in again}.isdisjoint({r["pid"] for r in ok})
        assert pool.spawned == 3 and pool.tasks == 4
        for r in again:  # both ranks gone at once before close: close collects them both
            os.kill(r["pid"], 9)
        time.sleep(0.5)
    finally:
        pool.close()
    assert not pool.alive


def test_without_a_pool_block_run_ranks_is_launch(monkeypatch):
    import rlaudit.backends.launch.pool as pool_mod

    calls = []
    monkeypatch.setattr(pool_mod, "_ACTIVE", [])  # outside the pytest session's pools too
    monkeypatch.setattr(pool_mod, "launch", lambda fn, world, **kw: calls.append((fn, world, kw))
                        or ["launched"])
    assert run_ranks(_sum_ranks, 2, pool="t", args=(1.0,), timeout=5) == ["launched"]
    assert calls and calls[0][0] is _sum_ranks and calls[0][2]["timeout"] == 5
    def script_fn(info):
        return info.rank

    script_fn.__module__, script_fn.__qualname__ = "__main__", "script_fn"
    with pytest.raises(InputError, match="do not import the main script"):
        RankPool(2).run(script_fn)  # refused before anything is spawned
    with warm_pools() as pools:
        assert pools.pool("t", 2) is pools.pool("t", 2)
        assert pools.pool("t", 2) is not pools.pool("u", 2)
        assert not pools.pool("t", 2).alive  # created on first use, not before


# ----------------------------------------------------------------------------- isolation


def _requests():
    from rlaudit.backends.base import ReplayRequest, Variant
    from rlaudit.config import load_config
    from rlaudit.data.io import load_rollout

    batch = load_rollout(REPO / "scenarios" / "rollouts" / "short-ref.safetensors")
    cfg = load_config({
        "rollout": {"n": 4, "response_length": 12},
        "actor": {"ppo_mini_batch_size": 2, "ppo_micro_batch_size_per_gpu": 1,
                  "calculate_entropy": True, "use_kl_loss": True, "kl_loss_type": "k3",
                  "optim": {"name": "sgd", "lr": 0.05}},
        "trainer": {"dtype": "float64", "seed": 3}})
    variants = [Variant("base", cfg, batch, steps=1)]
    models = {"model": str(REPO / "scenarios" / "models" / "qwen2-tiny-short"),
              "ref_model": str(REPO / "scenarios" / "models" / "qwen2-tiny")}
    out = {f"megatron-{k}": ("megatron", ReplayRequest(variants=variants, layout={k: 2},
                                                       dtype="float64", timeout=600, **models))
           for k in ("tp", "pp", "dp")}
    out["fsdp"] = ("fsdp", ReplayRequest(variants=variants, layout={"dp": 2}, dtype="float64",
                                         timeout=600, **models))
    return out


def _same(a, b, where: str) -> list[str]:
    """Bit-for-bit differences between two VariantRuns (timings aside)."""
    def eq(x, y):
        if isinstance(x, torch.Tensor):
            return x.shape == y.shape and bool(((x == y) | (x.isnan() & y.isnan())).all())
        return x == y

    problems = []
    steps = [[{k: v for k, v in s.items() if not k.startswith("timing/")} for s in r.steps]
             for r in (a, b)]
    if steps[0] != steps[1]:
        problems.append(f"{where}: metrics differ")
    if a.tokens.keys() != b.tokens.keys() or not all(eq(a.tokens[k], b.tokens[k])
                                                     for k in a.tokens):
        problems.append(f"{where}: per-token tensors differ")
    if len(a.params) != len(b.params) or not all(map(eq, a.params, b.params)):
        problems.append(f"{where}: parameters differ")
    for field in ("param_norms", "micro_log", "inputs_unchanged", "info", "param_names"):
        if getattr(a, field) != getattr(b, field):
            problems.append(f"{where}: {field} differs")
    return problems


@pytest.mark.slow
@pytest.mark.megatron
def test_results_do_not_depend_on_what_ran_before_in_the_pool():
    """Megatron TP, PP and DP layouts and FSDP, run forward and then backward through the same
    pools: each replay is bitwise the same whether it ran first (fresh ranks) or after the
    others (its predecessors' process groups, parallel_state, RNG and models behind it)."""
    pytest.importorskip("megatron.core")
    from rlaudit.backends.registry import get_backend

    requests = _requests()
    order = list(requests)
    results = {}
    with warm_pools() as pools:
        for label in order + order[::-1]:
            backend, request = requests[label]
            results.setdefault(label, []).append(get_backend(backend).replay(request))
        assert pools.stats == {"pools": 2, "spawned": 2, "tasks": 8, "respawned": 0}
    problems = []
    for label, (first, second) in results.items():
        for variant in first:
            problems += _same(first[variant], second[variant], f"{label}/{variant}")
    assert not problems, problems
    # and the layouts really ran: TP/PP/DP each give megatron's own layout record
    assert results["megatron-pp"][0]["base"].info["layout"] == {"tp": 1, "pp": 2, "dp": 1}
    assert len(results["fsdp"][0]["base"].micro_log[0]) == 2  # two ranks' micro-batch logs


# ----------------------------------------------------------------------------- start methods


def _has_megatron() -> bool:
    import importlib.util

    return importlib.util.find_spec("megatron") is not None


def _start_state(info):
    """What a pool rank looked like when its first task started: its parent, and whether the
    heavy modules were there before this task imported anything."""
    import sys

    heavy = ("transformers.models.qwen2.modeling_qwen2", "rlaudit.backends.fsdp",
             "torch.distributed.fsdp")
    return {"pid": os.getpid(), "ppid": os.getppid(),
            "preloaded": {m: m in sys.modules for m in heavy},
            "megatron": "megatron.core" in sys.modules,
            # megatron-core's torch.compile wrappers are deferred (megatron/imports.py)
            "compiler": "torch._inductor.compile_fx" in sys.modules}


@pytest.mark.slow
def test_cpu_pool_ranks_are_forked_from_the_preloaded_forkserver(monkeypatch):
    from rlaudit.backends.launch import start

    monkeypatch.delenv("RLAUDIT_START_METHOD", raising=False)
    pool = RankPool(2)
    try:
        out = pool.run(_start_state)
    finally:
        pool.close()
    server = start.forkserver_pid()
    assert server is not None
    assert [r["ppid"] for r in out] == [server, server]  # forked by the forkserver, not spawned
    for r in out:
        assert all(r["preloaded"].values()), r["preloaded"]  # imported before the task came
        assert r["megatron"] == _has_megatron() and not r["compiler"], r


@pytest.mark.slow
def test_spawn_start_method_is_honoured_and_bad_values_are_input_errors(monkeypatch):
    from rlaudit.backends.launch import start

    monkeypatch.setenv("RLAUDIT_START_METHOD", "spawn")
    assert start.start_method("cpu") == "spawn"
    pool = RankPool(1)
    try:
        out = pool.run(_start_state)
    finally:
        pool.close()
    assert out[0]["ppid"] == os.getpid() and not out[0]["preloaded"]["rlaudit.backends.fsdp"]
    monkeypatch.setenv("RLAUDIT_START_METHOD", "fork")
    with pytest.raises(InputError, match="RLAUDIT_START_METHOD"):
        start.start_method("cpu")
    monkeypatch.setenv("RLAUDIT_START_METHOD", "forkserver")
    assert start.start_method("cuda") == "spawn"  # a forked process cannot use CUDA


@pytest.mark.slow
@pytest.mark.megatron
def test_forked_and_spawned_ranks_give_bitwise_the_same_replays(monkeypatch):
    """The forkserver holds imported modules and nothing else: a replay in ranks forked from it
    is bit for bit the replay in freshly spawned ranks (FSDP and Megatron TP). Both backends
    replay in one two-rank group per start method (a spawned rank pays every import again,
    ~4.5 CPU-s; that a pool's replays do not depend on what ran before them is the test above)."""
    pytest.importorskip("megatron.core")
    from rlaudit.backends.fsdp import FSDPBackend
    from rlaudit.backends.megatron.backend import MegatronBackend
    from rlaudit.backends.registry import get_backend

    for cls, size in ((FSDPBackend, "dp"), (MegatronBackend, "tp")):
        monkeypatch.setattr(cls, "rank_pool",
                            lambda self, layout, size=size: ("shared", int(layout[size])))
    requests = {k: v for k, v in _requests().items() if k in ("fsdp", "megatron-tp")}
    results = {}
    for method in ("forkserver", "spawn"):
        monkeypatch.setenv("RLAUDIT_START_METHOD", method)
        with warm_pools() as pools:
            for label, (backend, request) in requests.items():
                results.setdefault(label, []).append(get_backend(backend).replay(request))
            assert pools.stats["spawned"] == 1 and pools.stats["tasks"] == 2
    problems = []
    for label, (forked, spawned) in results.items():
        for variant in forked:
            problems += _same(forked[variant], spawned[variant], f"{label}/{variant}")
    assert not problems, problems


@pytest.mark.slow
def test_prestart_brings_pools_up_before_their_first_task():
    with warm_pools() as pools:
        thread = pools.prestart([("t", 2, "cpu", 1), ("t", 2, "cpu", 1), ("u", 1, "cpu", 2)])
        thread.join(240)
        assert pools.pool("t", 2).alive and pools.pool("u", 1, threads_per_rank=2).alive
        out = run_ranks(_sum_ranks, 2, pool="t", args=(1.0,))
        assert [r["sum"] for r in out] == [3.0, 3.0]
        assert pools.stats == {"pools": 2, "spawned": 2, "tasks": 1, "respawned": 0}


@pytest.mark.slow
def test_an_unguarded_main_script_is_not_run_again_by_the_forkserver(tmp_path):
    """multiprocessing's forkserver re-imports the parent's __main__ by default: a script
    without an ``if __name__ == "__main__"`` guard would run twice. The pool's does not."""
    import subprocess
    import sys

    marker = tmp_path / "runs.txt"
    script = tmp_path / "unguarded.py"
    script.write_text(
        "import os, sys\n"
        f"sys.path.insert(0, {str(Path(__file__).parent)!r})\n"
        f"open({str(marker)!r}, 'a').write(str(os.getpid()) + '\\n')\n"
        "import test_pool as t\n"
        "from rlaudit.backends.launch.pool import RankPool\n"
        "pool = RankPool(1)\n"
        "print(pool.run(t._sum_ranks, args=(2.0,))[0]['sum'])\n"
        "pool.close()\n")
    env = {k: v for k, v in os.environ.items() if k != "RLAUDIT_START_METHOD"}
    out = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "2.0"
    assert len(marker.read_text().splitlines()) == 1  # the script ran once


def _heap_state(info):
    import gc
    import sys
    return {"frozen": gc.get_freeze_count(), "megatron": "megatron.core" in sys.modules}


def test_forked_ranks_start_with_the_preloaded_heap_frozen(monkeypatch):
    """The forkserver freezes what its imports built: a forked rank's full collections skip it
    (and leave its copy-on-write pages alone). Python's permanent generation starts empty, so
    anything in it came from that freeze."""
    pytest.importorskip("megatron.core")
    monkeypatch.setenv("RLAUDIT_START_METHOD", "forkserver")
    pool = RankPool(1)
    try:
        (seen,) = pool.run(_heap_state)
    finally:
        pool.close()
    assert seen["megatron"] and seen["frozen"] > 100_000
