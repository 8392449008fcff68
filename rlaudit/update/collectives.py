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


def full_tensors(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The whole tensors of DTensors (e.g. FSDP2's sharded parameters), as plain tensors.

    ``DTensor.full_tensor()`` is one collective per tensor; a model's parameters are many small
    tensors, and on a CPU box every gloo collective costs about a millisecond of wake-ups. Here
    the tensors sharded on dim 0 over the same 1-D mesh (FSDP2's layout) travel together: one
    ``all_gather_into_tensor`` per (mesh, dtype). Each rank's shard is ``torch.chunk(whole,
    world, dim=0)[rank]`` (empty past the last chunk), so every rank knows every shard's size
    without asking. Any other placement goes through ``full_tensor()``. A copy either way:
    the result is bit for bit what ``full_tensor()`` returns. Collective: every rank of the
    mesh calls it with the same names.
    """
    from torch.distributed.tensor import DTensor, Shard

    out: dict[str, torch.Tensor] = {}
    batches: dict[tuple, list[str]] = {}
    for name in sorted(tensors):
        t = tensors[name]
        if not isinstance(t, DTensor):
            out[name] = t
        elif t.device_mesh.ndim == 1 and tuple(t.placements) == (Shard(0),) and t.dim() > 0:
            batches.setdefault((id(t.device_mesh), t.dtype), []).append(name)
        else:
            out[name] = t.full_tensor()
    for names in batches.values():
        out.update(_gather_dim0_shards({n: tensors[n] for n in names}))
    return {name: out[name] for name in tensors}


def _gather_dim0_shards(dtensors: dict) -> dict[str, torch.Tensor]:
    first = next(iter(dtensors.values()))
    mesh = first.device_mesh
    group, world, me = mesh.get_group(), mesh.size(), mesh.get_local_rank()
    # per rank, per tensor: the shard's shape, as torch.chunk cuts it
    shapes = {}
    for name, t in dtensors.items():
        chunks = torch.empty(t.shape, device="meta").chunk(world, dim=0)
        shapes[name] = [tuple(chunks[r].shape) if r < len(chunks) else (0, *t.shape[1:])
                        for r in range(world)]
        local = t.to_local()
        if tuple(local.shape) != shapes[name][me]:
            raise RuntimeError(f"{name}: local shard {tuple(local.shape)} on rank {me} is not "
                               f"torch.chunk's {shapes[name][me]}")
    numel = [sum(_numel(shapes[n][r]) for n in dtensors) for r in range(world)]
    width = max(numel)
    flat = torch.zeros(width, dtype=first.dtype, device=first.to_local().device)
    if numel[me]:
        flat[: numel[me]] = torch.cat([t.to_local().reshape(-1) for t in dtensors.values()])
    everyone = torch.empty(world * width, dtype=flat.dtype, device=flat.device)
    dist.all_gather_into_tensor(everyone, flat, group=group)
    rows = everyone.view(world, width)
    offset = [0] * world
    out = {}
    for name in dtensors:
        parts = []
        for r in range(world):
            n = _numel(shapes[name][r])
            parts.append(rows[r, offset[r]: offset[r] + n].view(shapes[name][r]))
            offset[r] += n
        out[name] = torch.cat(parts, dim=0)
    return out


def _numel(shape: tuple) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
