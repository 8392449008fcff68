"""Cutting a batch for an update: global mini-batches -> this rank's shard -> micro-batches
(by count or token budget) -> padding micro-batches so every rank runs equally many passes, and the
global denominators every loss contribution is divided by.

Mini-batches are cut from the whole batch *before* sharding over data-parallel ranks, so the rows
that form an optimizer step do not depend on the number of ranks (DP-size invariance).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlaudit.algo.agg import Denominators
from rlaudit.data.batch import RolloutBatch
from rlaudit.data.batching import (is_padding_microbatch, microbatches_by_count,
                                   microbatches_by_tokens, pad_microbatch_list, shard_for_dp)


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
               max_token_len: int, norm_len: float, extra_padding: int = 0) -> MicroPlan:
    """Micro-batches of this rank's shard, padded to the max count over ranks, and the global
    denominators (token and sequence counts all-reduced over ranks)."""
    if len(shard) == 0:
        micros = []
    elif use_dynamic_bsz:
        micros = microbatches_by_tokens(shard, max_token_len)
    else:
        micros = microbatches_by_count(shard, micro_batch_size)
    num_real = len(micros)
    target = int(ctx.all_reduce(torch.tensor(num_real), op="max").item()) + extra_padding
    micros = pad_microbatch_list(micros, target, shard)
    local = Denominators.of(shard.mask, norm_len=norm_len)
    counts = ctx.all_reduce(torch.tensor([local.tokens, local.seqs], dtype=torch.float64))
    denom = Denominators(tokens=float(counts[0]), seqs=float(counts[1]), norm_len=norm_len)
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
