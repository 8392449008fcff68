"""Where warm pools' ranks run (rlaudit.backends.launch.placement): blocks of cores handed to
tasks least-busy first, nothing pinned when the cores suffice, a pool's ranks moving every thread
onto the task's cores and back, and the local executor sizing it for the groups in flight.

The rank functions are module-level (the ranks import them)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from rlaudit import switches
from rlaudit.backends.launch import placement
from rlaudit.backends.launch.placement import CorePlacement
from rlaudit.backends.launch.pool import RankPool
from rlaudit.errors import InputError

ROOT = Path(__file__).resolve().parents[2]


def _thread_cores(info):
    """Every thread's allowed cores, after starting a new gloo group (its threads are new)."""
    group = dist.new_group([0, 1])
    dist.all_reduce(torch.ones(1), group=group)
    return sorted({frozenset(os.sched_getaffinity(int(t))) for t in os.listdir("/proc/self/task")},
                  key=sorted)


# ----------------------------------------------------------------------------- the policy


def test_blocks_go_to_the_least_busy_first_and_come_back():
    p = CorePlacement([1, 0], groups=2)
    assert p.share == 1 and p.blocks == [(0,), (1,)]
    first, second = p.acquire(2), p.acquire(2)
    assert (first, second) == ((0,), (1,))
    assert p.acquire(2) == (0,)  # both busy once: the first of the least busy
    p.release((0,))
    p.release((0,))
    assert p.acquire(4) == (0,)  # core 0 free again, core 1 still has a task
    p.release(None)  # a task that was not placed gives nothing back


@pytest.mark.parametrize("cpus, groups, world, threads, device, expected", [
    ([0, 1], 1, 2, 1, "cpu", None),                    # one group, a core per rank: not pinned
    ([0, 1], 1, 4, 1, "cpu", (0, 1)),                  # four ranks on two cores: the block
    ([0, 1], 2, 1, 2, "cpu", None),                    # one rank: no collectives, not placed
    ([0, 1], 2, 2, 1, "cuda", None),                   # GPU ranks are never placed
    (list(range(16)), 4, 2, 1, "cpu", None),           # 16 cores, 4 groups: 4 cores for 2 ranks
    (list(range(16)), 4, 8, 1, "cpu", (0, 1, 2, 3)),   # ... and for 8, the first block of 4
    (list(range(5)), 2, 4, 1, "cpu", (0, 1)),          # 5 cores, 2 groups: blocks of 2, one spare
    ([], 2, 2, 1, "cpu", None),                        # no cores known: nothing to pin to
])
def test_placement_pins_only_groups_with_more_threads_than_their_share(cpus, groups, world,
                                                                       threads, device, expected):
    p = CorePlacement(cpus, groups=groups)
    assert p.acquire(world, device=device, threads_per_rank=threads) == expected


def test_placement_is_switched_off_by_the_environment_and_bad_values_are_input_errors(
        monkeypatch):
    monkeypatch.setenv(switches.PIN_RANKS, "off")
    assert placement.for_groups(2) is None
    monkeypatch.setenv(switches.PIN_RANKS, "always")
    with pytest.raises(InputError) as raised:
        placement.for_groups(2)
    assert switches.PIN_RANKS in str(raised.value) and "'auto' or 'off'" in str(raised.value)
    monkeypatch.setenv(switches.PIN_RANKS, "auto")
    p = placement.for_groups(2)
    if hasattr(os, "sched_setaffinity"):
        assert p is not None and p.cpus == sorted(os.sched_getaffinity(0)) and p.share >= 1
    else:  # nothing to pin with
        assert p is None


def test_groups_in_flight_count_the_multi_rank_backends_of_the_busiest_scenarios():
    from rlaudit.executors import groups_in_flight
    from rlaudit.scenarios.spec import load_scenario

    two = load_scenario(ROOT / "scenarios" / "kl_k1.yaml")        # fsdp dp=2, megatron tp=2
    assert set(two.backends) == {"reference", "fsdp", "megatron"}
    assert groups_in_flight([two], None, 2) == 2
    assert groups_in_flight([two, two, two], None, 2) == 4     # two scenarios at a time
    assert groups_in_flight([two, two], None, 1) == 2
    assert groups_in_flight([two, two], ["fsdp"], 2) == 2      # --backend fsdp: one group each
    assert groups_in_flight([two], ["reference"], 2) == 1      # none: still a share for 1


# ----------------------------------------------------------------------------- in the ranks


@pytest.mark.slow
@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(placement.usable_cpus()) < 2,
                    reason="needs thread affinity (Linux) and two usable cores")
def test_pool_ranks_move_every_thread_onto_the_task_cores_and_back():
    start = frozenset(placement.usable_cpus())
    core = min(start)
    pool = RankPool(2)
    try:
        pool.placement = CorePlacement(sorted(start), groups=len(start))  # blocks of one core
        pinned = pool.run(_thread_cores)
        # every thread of both ranks, the gloo threads of the group made during the task too
        assert pinned == [[frozenset({core})], [frozenset({core})]]
        assert pool.placement._busy[(core,)] == 0  # the block was given back
        pool.placement = None
        assert pool.run(_thread_cores) == [[start], [start]]
    finally:
        pool.close()


@pytest.mark.skipif(not placement.usable_cpus(), reason="needs thread affinity (Linux)")
def test_the_local_executor_sizes_the_placement_for_its_groups_in_flight(monkeypatch):
    from rlaudit.backends.launch.pool import warm_pools
    from rlaudit.executors import LocalExecutor, Progress
    from rlaudit.scenarios.spec import load_scenario

    scn = load_scenario(ROOT / "scenarios" / "kl_k1.yaml")
    monkeypatch.delenv(switches.PIN_RANKS, raising=False)
    with warm_pools() as pools:
        monkeypatch.setattr(pools, "prestart", lambda *a, **k: None)  # no ranks needed here
        with LocalExecutor(Progress(0, enabled=False), jobs=2, scenarios=[scn, scn, scn]):
            placed = pools.pool("fsdp", 2).placement
    assert placed is not None and placed.cpus == placement.usable_cpus()
    assert placed.share == max(1, len(placed.cpus) // 4)  # 2 scenarios x 2 groups
