"""A rollout's reward functions (rlaudit/data/rewards.py) as TRL's: one reward function per
function of the rollout, each returning its fixed scores, with the rollout's weights as
``reward_weights``; and the per-function means TRL logs, under rlaudit's names.

TRL combines them itself (``GRPOTrainer._generate_and_score_completions``: ``(rewards_per_func *
reward_weights).nansum(dim=1)``, a None score being NaN) and logs ``rewards/<name>/mean``
(``nanmean`` of the function's column) and ``reward`` (the mean combined reward); the name is the
function's ``__name__`` (``get_callable_name``)."""

from __future__ import annotations

from typing import Callable

from rlaudit.data.rewards import MASK, SCORES, metric_name, reward_functions


def reward_funcs(batch, single: Callable) -> tuple[list[Callable], list[float]]:
    """(TRL's reward functions, their weights) for ``batch``: each of its reward functions
    returning its column of ``reward_scores`` for the rows TRL asks (``row``: the batch rows of
    the generation) and None where ``reward_mask`` is False; without several functions,
    ``single`` (the batch's ``scores``) with weight 1."""
    funcs = reward_functions(batch.tensors, batch.meta)
    if funcs is None:
        return [single], [1.0]
    scores = batch[SCORES].tolist()
    applied = (batch[MASK].tolist() if MASK in batch
               else [[True] * len(funcs.names)] * len(scores))

    def column(f: int, name: str) -> Callable:
        def score(prompts, completions, row, **kwargs):
            return [scores[i][f] if applied[i][f] else None for i in row]
        score.__name__ = score.__qualname__ = name
        return score

    return [column(f, n) for f, n in enumerate(funcs.names)], list(funcs.weights)


def reward_metric_map(batch) -> dict[str, str]:
    """TRL's per-function reward means -> rlaudit's names, for a batch scored by several reward
    functions (empty otherwise: the one function's mean is ``reward``)."""
    funcs = reward_functions(batch.tensors, batch.meta)
    if funcs is None:
        return {}
    return {f"rewards/{n}/mean": metric_name(n) for n in funcs.names}
