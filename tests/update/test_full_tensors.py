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


def _rank_tensors(rank: int) -> dict[str, torch.Tensor]:
    """What rank ``rank`` sends: dtypes of 1, 2, 4 and 8 bytes (so the byte offsets after a
    header of any length are misaligned), an empty tensor, a non-contiguous one, a scalar, and
    sizes and names that differ between ranks."""
    g = torch.Generator().manual_seed(10 + rank)
    wide = torch.randn(4, 3 + rank, generator=g, dtype=torch.float64)
    return {"w": torch.randn(2 + rank, 3, generator=g, dtype=torch.float64),
            "bf": torch.randn(5, generator=g).to(torch.bfloat16),
            "mask": torch.rand(3, 2, generator=g) > 0.5,
            "ids": torch.randint(-9, 9, (rank + 1,), generator=g, dtype=torch.int64),
            "f32": torch.randn(3, generator=g, dtype=torch.float32),
            "empty": torch.zeros(0, 4),
            "strided": wide.t(),
            "scalar": torch.tensor(float(rank) - 0.5, dtype=torch.float64),
            f"only_on_{rank}": torch.full((rank + 2,), rank, dtype=torch.int32)}


def _gather_dicts(info):
    from rlaudit.update.collectives import all_gather_tensor_dicts

    mine = _rank_tensors(info.rank)
    return all_gather_tensor_dicts(("rank", info.rank, [1.5]), mine, group=None,
                                   size=info.world_size, device=torch.device("cpu"))


@pytest.mark.slow
def test_all_gather_tensor_dicts_brings_every_ranks_tensors_bit_for_bit():
    outs = launch(_gather_dicts, 2, timeout=300)
    for out in outs:  # every rank gets every rank's dict, in rank order
        assert [meta for meta, _ in out] == [("rank", 0, [1.5]), ("rank", 1, [1.5])]
        for rank, (_, got) in enumerate(out):
            sent = _rank_tensors(rank)
            assert list(got) == list(sent)
            for name, t in sent.items():
                g = got[name]
                assert g.dtype == t.dtype and g.shape == t.shape, name
                assert torch.equal(g, t), name
                assert g.is_contiguous()
