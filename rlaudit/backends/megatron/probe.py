"""The drift localisation's layer probe on a megatron-core GPTModel (see rlaudit/backends/probe.py).

Modules are hooked under their local megatron names and reported under HF names through the
converter's module map (:func:`rlaudit.backends.megatron.convert.module_names`), so the two sides
of a comparison line up module by module:

- outputs are sequence-first ``[s, b, ...]``: transposed to ``[b, s, ...]``;
- the output layer's logits (and their gradient) are split over TP along the padded vocabulary:
  gathered over the TP group and cut to the real vocabulary; every other module's output is
  whole on each TP rank (no sequence parallelism);
- each pipeline stage holds its own modules: stages are collected over the PP group;
- parameter gradients live in megatron DDP's ``main_grad`` buffers after the schedule's
  finalize (DP-reduced): gathered to HF names with the converter, TP shards included.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from rlaudit.backends.hooks import ModuleHooks
from rlaudit.backends.megatron.convert import (gather_hf_state_dict, module_names_of_stage,
                                               unwrap_model)
from rlaudit.backends.megatron.model import hf_model_spec

OUTPUT_LAYER = "output_layer"


def attach_hooks(ctx) -> ModuleHooks:
    """Hooks on this stage's modules (local megatron names), sequence-first outputs."""
    named = dict(unwrap_model(ctx.model).named_modules())
    return ModuleHooks({mg: named[mg] for mg in module_names_of_stage(ctx.hf_config)
                        if mg in named}, batch_dim=1)


def _gather_vocab(t: torch.Tensor, vocab_size: int) -> torch.Tensor:
    from megatron.core import parallel_state as ps  # lazy: megatron-core: optional, 4 s import

    tp = ps.get_tensor_model_parallel_world_size()
    if tp > 1:
        parts = [torch.empty_like(t) for _ in range(tp)]
        dist.all_gather(parts, t.contiguous(), group=ps.get_tensor_model_parallel_group())
        t = torch.cat(parts, dim=-1)
    return t[..., :vocab_size]


def collect(ctx, hooks: ModuleHooks) -> tuple[dict, dict]:
    """(outputs, gradients at the outputs) of every stage under HF module names, batch-first,
    on CPU; every rank of the model-parallel group must call it."""
    from megatron.core import parallel_state as ps  # lazy: megatron-core: optional, 4 s import

    names = module_names_of_stage(ctx.hf_config)
    vocab = hf_model_spec(ctx.hf_config).vocab_size
    mine = []
    for recorded in (hooks.outputs, hooks.grads):
        local = {}
        for mg, t in recorded.items():
            if mg == OUTPUT_LAYER:
                t = _gather_vocab(t, vocab)
            local[names[mg]] = t.transpose(0, 1).contiguous().cpu()
        mine.append(local)
    stages: list[Any] = [None] * ps.get_pipeline_model_parallel_world_size()
    dist.all_gather_object(stages, mine, group=ps.get_pipeline_model_parallel_group())
    outputs, grads = {}, {}
    for out, grad in stages:
        outputs.update(out)
        grads.update(grad)
    order = [n for st in range(len(stages)) for n in stages[st][0]]
    return {n: outputs[n] for n in order}, grads


def hf_grads(ctx) -> dict[str, torch.Tensor] | None:
    """DP-reduced gradients under HF names (collective over the model-parallel group), or None
    with the distributed optimizer at DP > 1 (its buffers hold only this rank's shard)."""
    ddp_cfg = getattr(ctx.model, "ddp_config", None)
    if getattr(ddp_cfg, "use_distributed_optimizer", False) and ctx.dp_size > 1:
        return None
    tensors = {}
    for name, p in unwrap_model(ctx.model).named_parameters():
        g = getattr(p, "main_grad", None)
        if g is None:
            g = p.grad if p.grad is not None else torch.zeros_like(p)
        tensors[name] = g
    return gather_hf_state_dict(ctx.model, ctx.hf_config, tensors=tensors)
