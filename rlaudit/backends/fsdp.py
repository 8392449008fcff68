"""The FSDP backend: the HF model sharded with FSDP2 (``fully_shard`` per decoder layer and at the
root) over a device mesh of ``dp`` ranks, replaying every variant inside one spawned group.

The update step is rlaudit's shared one (rlaudit/update): this module only says how to shard a
module. FSDP2 averages gradients over ranks in its reduce-scatter; the shared TorchContext
multiplies each loss contribution by the DP size so the accumulated gradient is the gradient of
the whole mini-batch loss (contributions are already divided by global counts).

Layout: ``{"dp": N}``. Device: CPU/gloo here, CUDA/NCCL on GPU machines (same code). dtype:
float32/float64 parameters, or bfloat16 mixed precision (fp32 master weights, bf16 compute,
fp32 gradient reduction) — meant for GPUs.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from rlaudit.backends import faults
from rlaudit.backends.base import ReplayRequest, VariantRun
from rlaudit.backends.launch.pool import run_ranks
from rlaudit.backends.reference import torch_roles
from rlaudit.backends.replay import replay_variant
from rlaudit.update import forward_memo


def _decoder_layers(module: torch.nn.Module):
    """The transformer blocks of an HF causal LM or of rlaudit's ValueModel."""
    body = getattr(module, "model", None) or getattr(module, "backbone", None)
    layers = getattr(body, "layers", None)
    if layers is None:
        raise TypeError(f"cannot find decoder layers in {type(module).__name__}")
    return list(layers)


def make_wrap(mesh, dtype: str):
    # lazy: FSDP2 APIs: needed only inside a rank
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = None
    if dtype == "bfloat16":
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)

    def wrap(module: torch.nn.Module) -> torch.nn.Module:
        kw = {"mesh": mesh} | ({"mp_policy": mp} if mp is not None else {})
        for layer in _decoder_layers(module):
            fully_shard(layer, **kw)
        fully_shard(module, **kw)
        return module

    return wrap


def _rank_main(info, request: ReplayRequest) -> dict[str, VariantRun]:
    """Runs in every rank: replay each variant with FSDP2-wrapped models."""
    # lazy: FSDP2 APIs: needed only inside a rank
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(info.device.type, (info.world_size,))
    # mixed precision keeps fp32 master weights; the policy casts compute to bf16
    param_dtype = "float32" if request.dtype == "bfloat16" else request.dtype
    wrap = make_wrap(mesh, request.dtype)
    out = {}
    with forward_memo.scope(info.device, request.forward_memo):
        for variant in request.variants:
            torch.manual_seed(variant.config.trainer.seed)
            make_roles = (lambda v: torch_roles(request.model, v, dtype=param_dtype,
                                                device=str(info.device), wrap=wrap,
                                                distributed=True,
                                                ref_model_path=request.ref_model))
            if request.faults:  # test-only (rlaudit/backends/faults.py)
                variant, make_roles = faults.inject(request.faults, "fsdp", variant, make_roles)
            run = replay_variant(make_roles, variant)
            if info.rank != 0:  # replay() reads rank 0's runs and every rank's micro-batch log:
                # the rest (parameters every step: megabytes a variant) stays here
                run = VariantRun(name=run.name, micro_log=run.micro_log)
            out[variant.name] = run
    return out


class FSDPBackend:
    name = "fsdp"

    #: the first torch whose torch.distributed.fsdp exports FSDP2's fully_shard
    MIN_TORCH = "2.6"

    def available(self) -> tuple[bool, str]:
        # by version, not by importing torch.distributed.fsdp: the CLI asks before every run,
        # and only the ranks (forked from a process that has it imported) need the module --
        # 0.6 CPU-s a run otherwise. A build without it fails in the ranks with the ImportError.
        if not dist.is_available():
            return False, "torch.distributed is not available"
        if torch.__version__ < self.MIN_TORCH:
            return False, (f"torch {torch.__version__} has no FSDP2 (fully_shard in "
                           f"torch.distributed.fsdp needs torch >= {self.MIN_TORCH})")
        return True, ""

    def rank_pool(self, layout: dict) -> tuple[str, int]:
        """The warm pool a replay with ``layout`` runs in: (pool name, world size)."""
        return "fsdp", int(layout.get("dp", 1))

    def replay(self, request: ReplayRequest) -> dict[str, VariantRun]:
        pool, dp = self.rank_pool(request.layout)
        # a warm pool when `rlaudit run` / a pytest session holds one, else a one-shot launch
        per_rank = run_ranks(_rank_main, dp, pool=pool, args=(request,),
                             device=request.device, timeout=request.timeout)
        runs = per_rank[0]
        for name, run in runs.items():
            # every rank's micro-batch log, step by step (rank order)
            run.micro_log = [[r[name].micro_log[step][0] for r in per_rank]
                             for step in range(len(run.micro_log))]
            run.info["layout"] = {"dp": dp}
        return runs
