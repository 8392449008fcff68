"""Collectives over a data-parallel group, shared by every ParallelContext.

Both return new tensors (inputs are never reduced in place) and are no-ops (copies) on one rank.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


def all_reduce(t: torch.Tensor, op: str, *, group, size: int, device) -> torch.Tensor:
    """A reduced copy of ``t`` over ``group`` (``op``: sum, max or min)."""
    out = t.detach().clone().to(device)
    if size > 1:
        dist.all_reduce(out, op=REDUCE_OPS[op], group=group)
    return out


def all_gather_rows(t: torch.Tensor, *, group, size: int, device) -> list[torch.Tensor]:
    """Every rank's ``t`` in rank order; dim 0 may differ between ranks (padded for the
    collective, trimmed after), the other dims must agree."""
    t = t.detach().contiguous().to(device)
    if size == 1:
        return [t.clone()]
    n = torch.tensor([t.shape[0]], device=device)
    sizes = [torch.zeros_like(n) for _ in range(size)]
    dist.all_gather(sizes, n, group=group)
    width = int(max(s.item() for s in sizes))
    padded = torch.zeros((width, *t.shape[1:]), dtype=t.dtype, device=device)
    padded[: t.shape[0]] = t
    bufs = [torch.empty_like(padded) for _ in range(size)]
    dist.all_gather(bufs, padded, group=group)
    return [b[: int(s.item())] for b, s in zip(bufs, sizes)]
