"""Simulated context parallelism in the shared update step (``actor.context_parallel_size``).

megatron-core 0.16.1's own CP cannot run on CPU (docs/internals.md, "Context parallelism"), so
the update step simulates a CP group of ``cp`` ranks per micro-batch, the way verl's Megatron
actor runs one:

- each sequence's tokens are divided over the ranks by the load-balanced ``2 * cp`` chunk split
  (:mod:`rlaudit.data.context_parallel`); a rank's model outputs carry gradient only for the
  response tokens it holds;
- every rank sees the other ranks' outputs as constants (verl all-gathers per-token outputs over
  the CP group and keeps the autograd graph only for its own chunk), so each rank computes the
  whole micro-batch's loss — row-level quantities (GSPO's sequence ratio, a row's token count)
  stay exact — and its backward yields *its tokens'* partial gradient;
- the CP group sums the partial gradients (the all-reduce); the metrics are every rank's (equal)
  full values, taken once.

The model itself runs on whole sequences: CP attention is exact, so the forward values are the
same as without CP; what the split exercises is the reduction. A correct split gives the cp = 1
result up to summation order (the ``cp-invariance`` invariant); a loss or metric reduced once
too often over the CP ranks, or scaled by ``cp``, does not.
"""

from __future__ import annotations

from typing import Callable

import torch

from rlaudit.data.batch import RolloutBatch
from rlaudit.data.context_parallel import response_token_ranks

#: rlaudit.update.context.LossFn (not imported: context imports plan, which imports this module)
LossFn = Callable[[RolloutBatch, dict], tuple[torch.Tensor, dict]]


def split_loss(loss_fn: LossFn, cp: int) -> LossFn:
    """``loss_fn`` run by a simulated CP group of ``cp`` ranks (see the module docstring).

    Returns a loss function with the same contract: its value is the micro-batch's loss
    contribution, its gradient the sum over ranks of each rank's partial gradient, its stats the
    (rank-independent) full stats. ``cp = 1`` returns ``loss_fn`` itself."""
    if cp == 1:
        return loss_fn

    def cp_loss(micro: RolloutBatch, outputs: dict) -> tuple[torch.Tensor, dict]:
        ranks = response_token_ranks(micro["prompt_lengths"], micro["response_lengths"],
                                     micro.response_width, cp).to(micro.mask.device)
        total, stats = None, None
        for r in range(cp):
            mine = ranks == r
            own = {k: _own(v, mine) for k, v in outputs.items()}
            loss_r, stats_r = loss_fn(micro, own)
            if total is None:            # rank 0's value: the whole micro-batch's loss
                total, stats = loss_r, stats_r
            else:                        # other ranks add their gradient, not their value
                total = total + (loss_r - loss_r.detach())
        return total, stats

    return cp_loss


def _own(t: torch.Tensor, mine: torch.Tensor) -> torch.Tensor:
    """``t`` ([b, R] or [b, R, K]) with gradient only where ``mine`` ([b, R]) is True."""
    if not t.requires_grad:
        return t
    m = mine.view(*mine.shape, *([1] * (t.dim() - 2)))
    return torch.where(m, t, t.detach())


__all__ = ["split_loss"]
