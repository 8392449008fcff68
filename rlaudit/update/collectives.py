"""Collectives over a process group, shared by every ParallelContext and backend.

Each returns new tensors (inputs are never reduced in place) and is a no-op (copies) on one rank.
"""

from __future__ import annotations

import math
import pickle

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


def all_gather_tensor_dicts(meta, tensors: dict[str, torch.Tensor], *, group, size: int,
                            device) -> list[tuple[object, dict[str, torch.Tensor]]]:
    """Every rank's ``(meta, tensors)`` in rank order, the tensors as CPU copies (bit for bit).

    What ``all_gather_object`` does with a dict of tensors, without pickling them: torch's
    tensor pickling made that 30 ms a call for a test model's state dict. Here the names, dtypes
    and shapes (and ``meta``, a small picklable value) are pickled and the tensors' raw bytes
    follow, all in one byte vector a rank; two collectives (:func:`all_gather_rows`)."""
    header = pickle.dumps((meta, [(n, t.dtype, tuple(t.shape)) for n, t in tensors.items()]))
    parts = [torch.tensor([len(header)], dtype=torch.int64).view(torch.uint8),
             torch.frombuffer(bytearray(header), dtype=torch.uint8)]
    parts += [t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
              for t in tensors.values()]
    every = all_gather_rows(torch.cat(parts), group=group, size=size, device=device)
    out = []
    for flat in every:
        flat = flat.to("cpu")
        n = int(flat[:8].clone().view(torch.int64))
        their_meta, layout = pickle.loads(flat[8:8 + n].numpy().tobytes())
        at, theirs = 8 + n, {}
        for name, dtype, shape in layout:
            nbytes = math.prod(shape) * dtype.itemsize
            theirs[name] = flat[at:at + nbytes].clone().view(dtype).reshape(shape)
            at += nbytes
        out.append((their_meta, theirs))
    return out


def full_tensors(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The whole tensors of DTensors (e.g. FSDP2's sharded parameters), as plain tensors.

    ``DTensor.full_tensor()`` is one collective per tensor; a model's parameters are many small
    tensors, and on a CPU box every gloo collective costs about a millisecond of wake-ups. Here
    the tensors sharded on dim 0 over the same 1-D mesh (FSDP2's layout) travel together, one
    :func:`all_gather_rows` of their flattened shards per (mesh, dtype); each rank's shard is
    ``torch.chunk(whole, world, dim=0)[rank]`` (empty past the last chunk), which says how to cut
    the gathered vectors back into tensors. Any other placement goes through ``full_tensor()``.
    A copy either way: the result is bit for bit what ``full_tensor()`` returns. Collective:
    every rank of the mesh calls it with the same names.
    """
    # lazy: DTensor: only FSDP2-sharded tensors need it
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


def full_params(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter of ``module`` whole (:func:`full_tensors`), detached and copied, by its
    name in the module (a Hugging Face model's own names). Collective: every rank calls it."""
    whole = full_tensors({name: p.detach() for name, p in module.named_parameters()})
    return {name: t.detach().clone() for name, t in whole.items()}


def _gather_dim0_shards(dtensors: dict) -> dict[str, torch.Tensor]:
    mesh = next(iter(dtensors.values())).device_mesh
    world, me = mesh.size(), mesh.get_local_rank()
    shapes = {}  # per tensor, per rank: the shard's shape, as torch.chunk cuts it
    for name, t in dtensors.items():
        chunks = torch.empty(t.shape, device="meta").chunk(world, dim=0)
        shapes[name] = [tuple(chunks[r].shape) if r < len(chunks) else (0, *t.shape[1:])
                        for r in range(world)]
        if tuple(t.to_local().shape) != shapes[name][me]:
            raise RuntimeError(f"{name}: local shard {tuple(t.to_local().shape)} on rank {me} is "
                               f"not torch.chunk's {shapes[name][me]}")
    local = torch.cat([t.to_local().reshape(-1) for t in dtensors.values()])
    per_rank = all_gather_rows(local, group=mesh.get_group(), size=world, device=local.device)
    parts: dict[str, list[torch.Tensor]] = {name: [] for name in dtensors}
    for r, flat in enumerate(per_rank):
        pieces = flat.split([math.prod(shapes[name][r]) for name in dtensors])
        for name, piece in zip(dtensors, pieces):
            parts[name].append(piece.view(shapes[name][r]))
    return {name: torch.cat(parts[name], dim=0) for name in dtensors}
