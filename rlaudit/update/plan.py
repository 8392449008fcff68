"""Cutting a batch for an update: global mini-batches -> this rank's shard -> micro-batches
(by count or token budget) -> padding micro-batches so every rank runs equally many passes, and the
global denominators every loss contribution is divided by.

Mini-batches are cut from the whole batch *before* sharding over data-parallel ranks, so the rows
that form an optimizer step do not depend on the number of ranks (DP-size invariance).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Callable

import torch

from rlaudit.algo.agg import Denominators
from rlaudit.data.batch import RolloutBatch
from rlaudit.data.batching import (is_padding_microbatch, microbatches_by_count,
                                   microbatches_by_tokens, pad_microbatch_list, shard_for_dp,
                                   split_minibatches)
from rlaudit.update.context_parallel import split_loss
from rlaudit.update.stats import MetricAccumulator, split_stats


@dataclass
class MicroPlan:
    """One rank's passes for one mini-batch. ``micros[i]`` is a micro-batch (padding ones have an
    all-False response_mask); ``num_real`` of them carry data; ``denom`` are the global counts
    of the whole mini-batch (all ranks)."""

    micros: list[RolloutBatch]
    num_real: int
    denom: Denominators


def rank_shard(ctx, minibatch: RolloutBatch, *, balance: bool) -> RolloutBatch:
    """This rank's rows of a mini-batch."""
    if ctx.dp_size == 1:
        return minibatch
    return shard_for_dp(minibatch, ctx.dp_size, balance=balance)[ctx.dp_rank]


def plan_micro(ctx, shard: RolloutBatch, *, micro_batch_size: int, use_dynamic_bsz: bool,
               max_token_len: int, norm_len: float, extra_padding: int = 0,
               seq_count: str = "valid-rows", tokens: float | None = None) -> MicroPlan:
    """Micro-batches of this rank's shard, padded to the max count over ranks, and the global
    denominators (token and sequence counts all-reduced over ranks; ``seq_count`` says which
    rows N_seq counts; ``tokens`` replaces N_tok when given: actor.loss_token_denominator)."""
    if len(shard) == 0:
        micros = []
    elif use_dynamic_bsz:
        micros = microbatches_by_tokens(shard, max_token_len)
    else:
        micros = microbatches_by_count(shard, micro_batch_size)
    num_real = len(micros)
    target = int(ctx.all_reduce(torch.tensor(num_real), op="max").item()) + extra_padding
    micros = pad_microbatch_list(micros, target, shard)
    local = Denominators.of(shard.mask, norm_len=norm_len, seq_count=seq_count)
    counts = ctx.all_reduce(torch.tensor([local.tokens, local.seqs], dtype=torch.float64))
    denom = Denominators(tokens=float(counts[0]) if tokens is None else tokens,
                         seqs=float(counts[1]), norm_len=norm_len)
    return MicroPlan(micros, num_real, denom)


def describe_micro(micro: RolloutBatch) -> dict:
    """What a micro-batch carried (for the padding/health invariants): rows, valid tokens,
    whether it is a padding micro-batch, and each field's kind, dtype and trailing shape."""
    return {
        "rows": len(micro),
        "tokens": int(micro.mask.sum()),
        "padding": is_padding_microbatch(micro),
        "fields": {k: [micro.kinds[k].value, str(v.dtype).replace("torch.", ""),
                       list(v.shape[1:])] for k, v in sorted(micro.tensors.items())},
    }


def optimizer_steps(ctx, batch: RolloutBatch, cfg, *, role: str, epochs: int,
                    micro_batch_size: int, spec, loss, grad_clip: float,
                    extra: Callable[[MicroPlan], dict] | None = None,
                    cp: int = 1) -> dict[str, float]:
    """The update loop of every role: ``epochs`` x global mini-batches of
    ``actor.ppo_mini_batch_size * rollout.n`` rows (verl's unit, in prompts), each one optimizer
    step: this rank's shard -> micro-batches (+ padding ones) -> forward/backward of
    ``loss(micro, outputs, cfg=, denom=)`` (run by a simulated context-parallel group of ``cp``
    ranks, :mod:`rlaudit.update.context_parallel`) -> global grad norm, clip, step.

    Returns the metrics averaged over optimizer steps: the loss's stats (summed over micro-batches
    and ranks: global mini-batch values), ``<role>/grad_norm`` (pre-clip), ``<role>/lr``, and
    whatever ``extra(plan)`` adds per step. With ``trainer.metric_reduction =
    "microbatch-mean"`` the loss's stats are instead each real micro-batch's local value,
    averaged over every micro-batch of every rank and optimizer step."""
    act = cfg.actor
    mb_rows = min(act.ppo_mini_batch_size * cfg.rollout.n, len(batch))
    norm_len = float(act.loss_scale_factor or batch.response_width)
    tr = cfg.trainer
    # any metric reduced as micro-batch means: the loss functions report local values too
    micro_mean = tr.metric_reduction == "microbatch-mean" or bool(tr.metric_reduction_except)
    acc = MetricAccumulator()
    tokens = None
    if act.loss_token_denominator == "batch-mean":   # the batch's tokens / mini-batches
        tokens = float(batch.mask.sum()) / -(-len(batch) // mb_rows)

    def loss_fn(micro, out, *, denom):
        local = (Denominators.of(micro.mask, norm_len=denom.norm_len,
                                 seq_count=act.loss_seq_count) if micro_mean else None)
        return loss(micro, out, cfg=cfg, denom=denom, stat_denom=local)

    for epoch in range(epochs):
        for mb in split_minibatches(batch, mb_rows, shuffle=act.shuffle,
                                    seed=cfg.trainer.seed + epoch):
            shard = rank_shard(ctx, mb, balance=cfg.trainer.balance_batch)
            plan = plan_micro(ctx, shard, micro_batch_size=micro_batch_size,
                              use_dynamic_bsz=act.use_dynamic_bsz,
                              max_token_len=act.ppo_max_token_len_per_gpu, norm_len=norm_len,
                              extra_padding=cfg.trainer.extra_padding_microbatches,
                              seq_count=act.loss_seq_count, tokens=tokens)
            ctx.zero_grad()
            results = ctx.forward_backward(plan.micros, spec,
                                           split_loss(partial(loss_fn, denom=plan.denom), cp))
            micro_stats = [r["stats"] for r in results]
            contrib, local = split_stats(micro_stats, tr.metric_mode)
            stats = acc.sum_micro_stats(ctx, contrib)
            if micro_mean:
                acc.add_micro_means(ctx, local, real=plan.num_real)
            stats[f"{role}/grad_norm"] = ctx.clip_and_step(grad_clip)
            stats[f"{role}/lr"] = ctx.lr
            if extra is not None:
                stats.update(extra(plan))
            acc.add_step(stats)
    return acc.mean()
