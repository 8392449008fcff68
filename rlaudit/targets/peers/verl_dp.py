"""verl's FSDP engine over two data-parallel ranks as a column of its own (``verl-fsdp-dp2-<v>``):
where a per-rank normaliser (a token count not all-reduced over the dp group, a loss scaled by
the local micro-batch count, a metric reduced on one rank) shows, and one rank cannot show it.

The column runs the scenario's ``base`` variant only (:data:`VARIANTS`) and is checked by
``dp-invariance`` only (:data:`INVARIANTS`): the other invariants already run on the one-rank
column, and a second copy of each would double the audit's time for nothing new. Its rows are
handed to verl in :func:`~rlaudit.targets.peers.verl_layout.dispatch_order`, so that each of
verl's optimizer steps trains the reference's mini-batch (verl's dispatcher gives each rank a
contiguous chunk and each rank cuts its own mini-batches); the per-token outputs are put back in
the rollout's order (:func:`restored`). dp-invariance compares it with the one-rank reference
on the metrics whose value does not depend on how micro-batches are cut.
"""

from __future__ import annotations

import dataclasses

import torch

from rlaudit.config import Config
from rlaudit.data.batch import RolloutBatch
from rlaudit.targets.contract.adapter import TrainStepOutput
from rlaudit.targets.peers.verl_layout import dispatch_order
from rlaudit.targets.peers.verl_train import mini_rows

#: the column's data-parallel size
DP = 2
#: the variants it runs, and the only invariant checked on it (module docstring)
VARIANTS = ("base",)
INVARIANTS = ("dp-invariance",)


def laid_out(batch: RolloutBatch, cfg: Config, dp: int) -> tuple[RolloutBatch, list[int]]:
    """``batch`` in the order that makes verl's per-rank mini-batches the reference's, and that
    order (row ``order[p]`` at position ``p``)."""
    order = dispatch_order(len(batch), mini_rows(cfg, len(batch)), dp)
    return batch.select(order), order


def restored(out: TrainStepOutput, order: list[int]) -> TrainStepOutput:
    """``out``'s per-token tensors (computed on the rows laid out in ``order``) back in the
    rollout's row order; metrics and parameters do not depend on it."""
    index = torch.as_tensor(order, dtype=torch.long)

    def back(t):
        if t is None:
            return None
        res = torch.empty_like(t)
        res[index] = t
        return res

    return dataclasses.replace(out, log_probs=back(out.log_probs), entropy=back(out.entropy),
                               tokens={k: back(v) for k, v in out.tokens.items()})


__all__ = ["DP", "INVARIANTS", "VARIANTS", "laid_out", "restored"]
