"""verl's DP ranks as threads in one process, for the stage-level micro-batch cut: verl's own
``seqlen_balancing`` collective logic (micro-batch counts all-reduced over the DP group) runs
unchanged against a stand-in for ``torch.distributed`` that meets every rank at a barrier."""

from __future__ import annotations

import threading
from typing import Any

import torch


class ThreadGroup:
    """DP ranks as threads, with a stand-in for ``torch.distributed`` that verl's
    ``seqlen_balancing`` module uses while they run: ``all_reduce`` (MAX/MIN/SUM) meets every
    rank at a barrier, as the collective does. verl 0.9 has no CPU platform (its device name is
    ``cuda`` without a GPU), so the module's ``get_device_name`` is pointed at ``cpu`` too."""

    TIMEOUT_S = 60.0

    def __init__(self, world: int):
        self.world = world
        self.barrier = threading.Barrier(world, timeout=self.TIMEOUT_S)
        self.slots: list[Any] = [None] * world

    # what seqlen_balancing calls on ``dist``
    ReduceOp = torch.distributed.ReduceOp

    def is_initialized(self) -> bool:
        return True

    def all_reduce(self, tensor, op=torch.distributed.ReduceOp.SUM, group=None):
        rank = group.rank
        self.slots[rank] = tensor.detach().clone()
        self.barrier.wait()
        stacked = torch.stack(self.slots)
        if op == torch.distributed.ReduceOp.MAX:
            out = stacked.max(dim=0).values
        elif op == torch.distributed.ReduceOp.MIN:
            out = stacked.min(dim=0).values
        elif op == torch.distributed.ReduceOp.SUM:
            out = stacked.sum(dim=0)
        else:
            raise NotImplementedError(f"all_reduce op {op}")
        self.barrier.wait()
        tensor.copy_(out)

    def run(self, fn):
        """``fn(rank, group)`` on every rank in its own thread; results in rank order."""
        # lazy: verl is optional, imported when audited
        from verl.utils import seqlen_balancing as sb
        results: list[Any] = [None] * self.world
        errors: list[BaseException | None] = [None] * self.world

        def body(rank):
            try:
                results[rank] = fn(rank, Rank(rank))
            except BaseException as e:  # noqa: BLE001  (re-raised in the caller's thread)
                errors[rank] = e
                self.barrier.abort()

        saved = sb.dist, sb.get_device_name
        sb.dist, sb.get_device_name = self, (lambda: "cpu")
        try:
            threads = [threading.Thread(target=body, args=(r,)) for r in range(self.world)]
            for th in threads:
                th.start()
            for th in threads:
                th.join()
        finally:
            sb.dist, sb.get_device_name = saved
        first = next((e for e in errors if e is not None
                      and not isinstance(e, threading.BrokenBarrierError)), None)
        if first is None:
            first = next((e for e in errors if e is not None), None)
        if first is not None:
            raise first
        return results


class Rank:
    """The ``dp_group`` handed to verl: only carries the rank for :class:`ThreadGroup`."""

    def __init__(self, rank: int):
        self.rank = rank
