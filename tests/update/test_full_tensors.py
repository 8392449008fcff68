"""collectives.full_tensors: every FSDP2-sharded parameter made whole in one all_gather_rows (two
collectives: the shard sizes, then every shard at once), bit for bit what DTensor.full_tensor()
gives (the parity checks compare parameters gathered this way).

Shapes chosen so that torch.chunk cuts unevenly: 5 rows over 2 ranks (3 + 2), 1 row (rank 1
empty), a 1-D bias, and a replicated DTensor (not Shard(0): falls back to full_tensor).
"""

from __future__ import annotations

import pytest
import torch

from rlaudit.backends.launch import launch


def _gather(info):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, distribute_tensor

    from rlaudit.update.collectives import full_tensors

    torch.manual_seed(0)  # the same whole model on every rank, before sharding
    model = torch.nn.Sequential(torch.nn.Linear(4, 5, dtype=torch.float64),
                                torch.nn.Linear(5, 1, dtype=torch.float64),
                                torch.nn.Linear(1, 3, dtype=torch.float32))
    whole = {n: p.detach().clone() for n, p in model.named_parameters()}
    mesh = init_device_mesh("cpu", (info.world_size,))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    params = {n: p.detach() for n, p in model.named_parameters()}
    params["replicated"] = distribute_tensor(torch.arange(6.0).view(2, 3), mesh, [Replicate()])
    params["plain"] = torch.ones(2)
    dist.barrier()
    got = full_tensors(params)
    expected = {n: (t.full_tensor() if hasattr(t, "full_tensor") else t)
                for n, t in params.items()}
    local_rows = {n: tuple(p.to_local().shape) for n, p in model.named_parameters()}
    return {"got": got, "expected": expected, "whole": whole, "local": local_rows,
            "order": list(got)}


@pytest.mark.slow
def test_full_tensors_is_full_tensor_bit_for_bit_with_uneven_shards():
    outs = launch(_gather, 2, timeout=300)
    for out in outs:
        assert out["order"][:6] == [n for n in out["whole"]]  # the caller's order kept
        for name, t in out["expected"].items():
            g = out["got"][name]
            assert g.dtype == t.dtype and g.shape == t.shape and torch.equal(g, t), name
        for name, t in out["whole"].items():  # and it is the unsharded model's parameter
            assert torch.equal(out["got"][name], t), name
    r0, r1 = (o["local"] for o in outs)
    assert r0["1.weight"] == (1, 5) and r1["1.weight"] == (0, 5)  # the uneven case really ran
    assert r0["0.weight"] == (3, 4) and r1["0.weight"] == (2, 4)
