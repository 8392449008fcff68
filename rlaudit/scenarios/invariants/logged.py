"""The value a logged loss-term metric should have, recomputed from per-token tensors, as the
backend reduces it over micro-batches (``trainer.metric_mode(name)``).

``contribution`` (rlaudit's): the metric is the whole mini-batch's aggregate,
``naive_agg(x, mask, loss_agg_mode)``. ``microbatch-mean`` (a target's declared reduction: verl's
``AggregationType.MEAN``, TRL): each real micro-batch reports its own local aggregate and the
logged value is their mean, so recomputing it needs the rows of each micro-batch
(:func:`microbatch_rows`). Both honour the declared ``actor.loss_seq_count`` (N_seq over the rows
with a valid token, or over every row).

Used by the invariants that compare a logged metric with a recomputation on a variant whose
step 0 is one optimizer step over the whole batch (``seeds.one_minibatch``): there the mini-batch
is the batch, so ``actor.loss_token_denominator`` (the batch's tokens / mini-batches) is the
mini-batch's token count.
"""

from __future__ import annotations

import torch

from rlaudit.data.batching import (plan_dp_shards, plan_microbatches_by_count,
                                   plan_microbatches_by_tokens)
from rlaudit.errors import InputError
from rlaudit.scenarios.invariants.naive import naive_agg


def microbatch_rows(run, cfg, batch) -> list[torch.Tensor] | None:
    """Row indices of each real micro-batch of the first optimizer step of ``run``'s step 0.

    From the run's ``micro_log`` when it has one: each rank's shard (rlaudit's DP plan,
    ``plan_dp_shards`` with ``trainer.balance_batch``) cut in order by the logged row counts,
    every piece checked against the logged token count (padding micro-batches follow the real
    ones and are skipped). Without a log: the config's cut of one rank
    (``ppo_micro_batch_size_per_gpu`` consecutive rows, or the token budget in order). None when
    the logged micro-batches do not fit that plan (rows unknown)."""
    act = cfg.actor
    if not run.micro_log or not run.micro_log[0]:
        if act.use_dynamic_bsz:
            return plan_microbatches_by_tokens(batch.sequence_lengths(),
                                               act.ppo_max_token_len_per_gpu)
        return plan_microbatches_by_count(len(batch), act.ppo_micro_batch_size_per_gpu)
    ranks = run.micro_log[0]
    mask = batch.mask
    try:
        shards = plan_dp_shards(batch.sequence_lengths(), len(ranks),
                                balance=cfg.trainer.balance_batch)
    except InputError:   # a layout rlaudit's plan cannot produce (rows not divisible)
        return None
    for k in range(min(len(opt) for opt in ranks)):   # the first optimizer step that fits
        out: list[torch.Tensor] = []
        for rows, opt_steps in zip(shards, ranks):
            start, fits = 0, True
            for m in opt_steps[k]:
                if start >= len(rows):
                    break          # the rest are padding micro-batches
                piece = rows[start:start + int(m["rows"])]
                if len(piece) != int(m["rows"]) or int(mask[piece].sum()) != int(m["tokens"]):
                    fits = False
                    break
                out.append(piece)
                start += len(piece)
            if not fits or start != len(rows):
                break
        else:
            return out
    return None


def logged_agg(name: str, per_token: torch.Tensor, mask: torch.Tensor, cfg,
               micros: list[torch.Tensor] | None, mode: str | None = None) -> float | None:
    """Metric ``name`` as the backend logs it: ``per_token`` ``[B, R]`` aggregated with ``mode``
    (default ``actor.loss_agg_mode``) over the whole batch, or the mean over ``micros`` (row
    indices per micro-batch) of each micro-batch's own aggregate when ``name`` is reduced as a
    micro-batch mean (None then if ``micros`` is None: the rows are unknown)."""
    act = cfg.actor
    kw = dict(norm_len=act.loss_scale_factor, seq_count=act.loss_seq_count)
    mode = mode or act.loss_agg_mode
    if cfg.trainer.metric_mode(name) == "contribution":
        return naive_agg(per_token, mask, mode, **kw)
    if not micros:
        return None
    values = [naive_agg(per_token[rows], mask[rows], mode, **kw) for rows in micros]
    return sum(values) / len(values)
