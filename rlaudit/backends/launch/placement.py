"""Which CPU cores a warm pool's ranks run on, task by task, when there are fewer cores than ranks.

On CPU, the ranks of one group move in lock step: every collective waits for all of them, and
each one wakes the peers' processes and gloo's own threads (the caller, gloo's worker, its
socket loop). When those wake-ups cross cores they are dear -- on a 2-vCPU VM, measured by
``benchmarks/rank_placement.py``: an all-reduce of 30 KB between two processes costs each about
0.8 ms of CPU, mostly in the kernel, when the two float over both cores, and 0.25 ms when both are
on one. A Megatron TP=2 replay runs thousands of them (``drgrpo_sum_norm`` when it replayed Megatron at
TP=2: 4112 per rank).

So when the groups that may run at once have more ranks than the machine has cores (a scenario's
FSDP and Megatron groups on 2 cores, say), :class:`CorePlacement` gives each task a block of
cores of its own -- ``cores // groups in flight`` of them, the least busy block when the task
starts -- and the pool's ranks move all their threads onto it for the task
(``_pool_worker.Placed``). With cores enough for every rank of every group in flight,
nothing is pinned. Placement changes where ranks run, never what they compute (one intra-op
thread per rank): results are bit for bit the same.

``rlaudit run`` places its own pools (the local executor); other users of warm pools (a pytest
session's) do not. ``RLAUDIT_PIN_RANKS=off`` turns it off, e.g. on a machine shared with other
work, where a pinned group cannot move away from a core that something else keeps busy.
"""

from __future__ import annotations

import os
import threading
from typing import Sequence

from rlaudit import switches

def usable_cpus() -> list[int]:
    """The cores this process may run on (its affinity: cgroups and ``taskset`` respected);
    empty where the platform cannot pin threads."""
    if not hasattr(os, "sched_getaffinity") or not hasattr(os, "sched_setaffinity"):
        return []
    return sorted(os.sched_getaffinity(0))


def placement_enabled() -> bool:
    """``$RLAUDIT_PIN_RANKS``: ``auto`` (the default: pin when oversubscribed) or ``off``."""
    return switches.pin_ranks()


class CorePlacement:
    """Blocks of ``len(cpus) // groups`` consecutive cores; :meth:`acquire` hands a task the
    block with the fewest tasks on it (the first such), :meth:`release` gives it back.

    ``groups``: how many rank groups may run at once (the local executor: its scenarios in
    flight times their multi-rank backends)."""

    def __init__(self, cpus: Sequence[int], *, groups: int):
        self.cpus = sorted(set(cpus))
        self.share = max(1, len(self.cpus) // max(1, groups))
        self.blocks = [tuple(self.cpus[i:i + self.share])
                       for i in range(0, len(self.cpus) - self.share + 1, self.share)]
        self._busy = {block: 0 for block in self.blocks}
        self._lock = threading.Lock()

    def acquire(self, world_size: int, *, device: str = "cpu",
                threads_per_rank: int = 1) -> tuple[int, ...] | None:
        """The cores for a task of a group of ``world_size`` ranks, or None (run anywhere): on a
        GPU, for one rank (no collectives to keep on a core: the local executor's pooled
        reference replays, whatever their threads, float as the CLI's own replays did), or when
        its block would hold every thread of the group anyway."""
        if (device != "cpu" or not self.blocks or world_size < 2
                or self.share >= world_size * threads_per_rank):
            return None
        with self._lock:
            block = min(self.blocks, key=lambda b: self._busy[b])  # first of the least busy
            self._busy[block] += 1
            return block

    def release(self, block: tuple[int, ...] | None) -> None:
        if block is None:
            return
        with self._lock:
            self._busy[block] -= 1


def for_groups(groups: int) -> CorePlacement | None:
    """The placement for ``groups`` rank groups in flight on this machine, or None where
    nothing would be pinned (switched off, or a platform without thread affinity)."""
    if not placement_enabled():
        return None
    cpus = usable_cpus()
    if not cpus:
        return None
    return CorePlacement(cpus, groups=groups)


def pin_threads(cpus: Sequence[int]) -> bool:
    """Move every thread of this process onto ``cpus`` (threads started later inherit their
    creator's cores). False where the platform cannot, or the cores were refused."""
    if not hasattr(os, "sched_setaffinity"):
        return False
    mask = set(cpus)
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        tids = [0]  # no /proc: this thread only
    moved = False
    for tid in tids:
        try:
            os.sched_setaffinity(tid, mask)
            moved = True
        except (OSError, ValueError):  # a thread that just ended; cores outside the cgroup
            continue
    return moved
