"""Several reward functions in a rollout: their per-function scores, weights and the combined score.

A rollout scored by several reward functions (TRL's ``reward_funcs`` with ``reward_weights``, a
verl reward manager returning several scores) carries, besides the required fields:

- ``reward_scores`` (seq, float ``[B, F]``): function f's score of row i, finite everywhere;
- ``reward_mask`` (seq, bool ``[B, F]``, optional): True where function f scored row i (TRL: the
  function returned a number, not None); every row needs at least one (a row no function scored
  has no reward: TRL zeroes its advantage, rlaudit's reference has no such convention);
- in the sidecar's ``meta``: ``reward_functions`` (F names, distinct Python identifiers: TRL
  logs ``rewards/<name>/mean``) and ``reward_weights`` (F finite numbers; default 1 each, as TRL).

``scores`` is then the combined score (:func:`rlaudit.algo.reward.combine_reward_scores`: each
row's weighted sum over the functions that scored it). :func:`with_combined_scores` computes it
when a file leaves it out and refuses a file whose ``scores`` disagree. Every problem is an
:class:`~rlaudit.errors.InputError` naming the file and the field or meta key.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping

import torch

from rlaudit.algo.reward import combine_reward_scores
from rlaudit.errors import InputError

SCORES = "reward_scores"
MASK = "reward_mask"
NAMES = "reward_functions"
WEIGHTS = "reward_weights"
#: the catalogue-style name of function ``name``'s logged mean (beside ``critic/score/mean``)
METRIC = "critic/score/{}/mean"
#: how far a file's own ``scores`` may be from the combined score (float32 storage)
SCORES_RTOL, SCORES_ATOL = 1e-6, 1e-6


@dataclass(frozen=True)
class RewardFunctions:
    names: tuple[str, ...]
    weights: tuple[float, ...]

    def metric(self, index: int) -> str:
        return METRIC.format(self.names[index])


def metric_name(function: str) -> str:
    """The metric a trainer logs function ``function``'s mean score under (rlaudit's name)."""
    return METRIC.format(function)


def reward_functions(tensors: Mapping[str, torch.Tensor], meta: Mapping[str, object], *,
                     source: str | None = None) -> RewardFunctions | None:
    """The rollout's reward functions (None when it has one score per row only), checked against
    ``reward_scores`` and ``reward_mask``."""
    names, scores = meta.get(NAMES), tensors.get(SCORES)
    if names is None and scores is None:
        for key, where in ((WEIGHTS, "meta"), (MASK, "field")):
            if (meta.get(key) if where == "meta" else tensors.get(key)) is not None:
                raise InputError(f"{key} without reward_scores and meta.reward_functions",
                                 source=source, key=key if where == "field" else f"meta.{key}")
        return None
    if scores is None:
        raise InputError(f"meta.reward_functions names {names!r} but the rollout has no "
                         f"reward_scores field ([B, F] per-function scores)", source=source,
                         key=SCORES)
    if names is None:
        raise InputError("reward_scores without meta.reward_functions (one name per column)",
                         source=source, key=f"meta.{NAMES}")
    if (not isinstance(names, list) or not names
            or not all(isinstance(n, str) and n.isidentifier() for n in names)
            or len(set(names)) != len(names)):
        raise InputError(f"expected a non-empty list of distinct identifiers, got {names!r}",
                         source=source, key=f"meta.{NAMES}")
    if not scores.is_floating_point() or not bool(torch.isfinite(scores).all()):
        raise InputError(f"expected finite float scores (a function that did not score a row: "
                         f"reward_mask False there), got {scores.dtype}"
                         + ("" if not scores.is_floating_point() else " with NaN/inf"),
                         source=source, key=SCORES)
    if scores.dim() != 2 or scores.shape[1] != len(names):
        raise InputError(f"expected shape [B, F={len(names)}] (one column per reward function), "
                         f"got {list(scores.shape)}", source=source, key=SCORES)
    weights = meta.get(WEIGHTS, [1.0] * len(names))
    if (not isinstance(weights, list) or not all(
            isinstance(w, (int, float)) and not isinstance(w, bool) and math.isfinite(w)
            for w in weights)):
        raise InputError(f"expected a list of finite numbers, got {weights!r}", source=source,
                         key=f"meta.{WEIGHTS}")
    if len(weights) != len(names):
        raise InputError(f"{len(weights)} weights for {len(names)} reward functions {names}",
                         source=source, key=f"meta.{WEIGHTS}")
    _check_mask(tensors, len(names), source)
    return RewardFunctions(tuple(names), tuple(float(w) for w in weights))


def _check_mask(tensors, functions: int, source) -> None:
    mask = tensors.get(MASK)
    if mask is None:
        return
    if mask.dtype != torch.bool or list(mask.shape) != list(tensors[SCORES].shape):
        raise InputError(f"expected a bool tensor of shape {list(tensors[SCORES].shape)}, got "
                         f"{mask.dtype} {list(mask.shape)}", source=source, key=MASK)
    unscored = (~mask.any(1)).nonzero().flatten().tolist()
    if unscored:
        raise InputError(f"rows {unscored} are scored by none of the {functions} reward "
                         f"functions: every row needs a score (TRL zeroes such a row's "
                         f"advantage; rlaudit's reference has no such convention)",
                         source=source, key=MASK)


def combined(tensors: Mapping[str, torch.Tensor], funcs: RewardFunctions) -> torch.Tensor:
    """[B] float64: the rollout's combined score (module docstring)."""
    return combine_reward_scores(tensors[SCORES], funcs.weights, tensors.get(MASK))


def with_combined_scores(tensors: Mapping[str, torch.Tensor], meta: Mapping[str, object], *,
                         source: str | None = None) -> dict[str, torch.Tensor]:
    """``tensors`` with ``scores`` set to the combined score when the rollout has several reward
    functions and leaves ``scores`` out; unchanged otherwise (checked by
    :func:`check_combined_scores` when the batch is validated)."""
    out = dict(tensors)
    funcs = reward_functions(out, meta, source=source)
    if funcs is not None and "scores" not in out:
        out["scores"] = combined(out, funcs)
    return out


def check_combined_scores(tensors: Mapping[str, torch.Tensor], meta: Mapping[str, object], *,
                          source: str | None = None) -> None:
    """With several reward functions, ``scores`` must be their combined score (the first row
    that differs is named)."""
    funcs = reward_functions(tensors, meta, source=source)
    if funcs is None:
        return
    if "scores" not in tensors:
        raise InputError("the batch has reward_scores but no scores (their combined score)",
                         source=source, key="scores")
    want, got = combined(tensors, funcs), tensors["scores"].double()
    bad = ~torch.isclose(got, want, rtol=SCORES_RTOL, atol=SCORES_ATOL)
    if bool(bad.any()):
        i = int(bad.nonzero()[0])
        raise InputError(f"row {i}: scores {float(got[i]):.8g} is not the weighted sum of "
                         f"reward_scores over the functions that scored it "
                         f"({float(want[i]):.8g}, weights {list(funcs.weights)}); leave scores "
                         f"out and rlaudit computes it", source=source, key="scores")
