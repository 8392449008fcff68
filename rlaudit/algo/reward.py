"""Token-level rewards: placing sequence scores on tokens, and KL-in-reward shaping.

Pipeline (verl's): ``scores [B]`` -> :func:`place_scores` -> ``token_level_scores [B, R]`` ->
:func:`apply_kl_in_reward` (optional) -> ``token_level_rewards [B, R]``.

Everything here is built **out of place**. The bug this module exists to avoid (slime PR #2114,
docs/findings.md, seeds): the stored per-token KL, later logged as ``rollout/kl``, aliased the
tensor that reward shaping then scaled and added to in place, so the logged KL became the reward.
Here the returned ``kl`` and ``token_level_rewards`` are fresh tensors that share no storage with
each other or with any input, and no input is written to.
"""

from __future__ import annotations

import torch

from rlaudit.algo.agg import bool_mask, masked_mean
from rlaudit.algo import kl as kl_estimators
from rlaudit.errors import InputError


def _check_float(name: str, t, shape=None) -> None:
    if not isinstance(t, torch.Tensor) or not t.is_floating_point():
        raise InputError(f"expected a float tensor, got {getattr(t, 'dtype', type(t).__name__)}",
                         key=name)
    if shape is not None and tuple(t.shape) != tuple(shape):
        raise InputError(f"expected shape {tuple(shape)}, got {tuple(t.shape)}", key=name)


def place_scores(scores: torch.Tensor, response_lengths: torch.Tensor, width: int) -> torch.Tensor:
    """Put each row's score on its last response token.

    Args:
        scores: [B] float, one score per trajectory.
        response_lengths: [B] int, in ``[0, width]``.
        width: R, the padded response width.

    Returns:
        ``token_level_scores`` [B, R] (dtype of ``scores``): ``scores[i]`` at ``[i, len_i - 1]``,
        0 elsewhere. A row with length 0 has no token to carry its score: it gets all zeros and
        **its score is dropped** (it then contributes nothing to any advantage).
    """
    _check_float("scores", scores)
    if scores.dim() != 1:
        raise InputError(f"expected shape [B], got {tuple(scores.shape)}", key="scores")
    lens = response_lengths
    if (not isinstance(lens, torch.Tensor) or lens.is_floating_point() or lens.dtype == torch.bool
            or tuple(lens.shape) != tuple(scores.shape)):
        raise InputError(f"expected an integer tensor of shape {tuple(scores.shape)}, got "
                         f"{getattr(lens, 'dtype', type(lens).__name__)} "
                         f"{tuple(getattr(lens, 'shape', ()))}", key="response_lengths")
    if int(width) < 0:
        raise InputError(f"expected a width >= 0, got {width}", key="width")
    if lens.numel() and (int(lens.min()) < 0 or int(lens.max()) > int(width)):
        raise InputError(f"lengths must be in [0, width={int(width)}], got "
                         f"[{int(lens.min())}, {int(lens.max())}]", key="response_lengths")
    positions = torch.arange(int(width), device=scores.device)
    last = positions.unsqueeze(0) == (lens.to(scores.device) - 1).unsqueeze(1)   # [B, R]
    return torch.where(last, scores.unsqueeze(1), 0.0)


def apply_kl_in_reward(token_level_scores: torch.Tensor, old_log_probs: torch.Tensor,
                       ref_log_probs: torch.Tensor, mask: torch.Tensor, *, kl_coef: float,
                       kl_penalty: str, k3_clamp: str = kl_estimators.DEFAULT_K3_CLAMP
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """KL-in-reward: ``rewards = token_level_scores - kl_coef * kl`` with
    ``kl = kl_penalty(old_log_probs, ref_log_probs, kind)`` on mask-1 tokens and 0 elsewhere.

    Args:
        token_level_scores, old_log_probs, ref_log_probs: [B, R] float.
        mask: [B, R] bool or 0/1; True = the token counts. Log-probs under mask 0 are never read
            (NaN/inf there does not leak); scores under mask 0 pass through unchanged.
        kl_coef: the coefficient (``algorithm.kl_coef``).
        kl_penalty: the estimator name (``algorithm.kl_penalty``: k1/kl, abs, k2/mse,
            k3/low_var_kl, ...).
        k3_clamp: k3's value clamp (``algorithm.k3_clamp``, :data:`rlaudit.algo.kl.K3_CLAMPS`).

    Returns:
        ``(token_level_rewards, kl)``, both new [B, R] tensors that alias neither each other nor
        any input; the inputs are not modified. ``kl`` is what ``rollout/kl`` logs.
    """
    _check_float("token_level_scores", token_level_scores)
    if token_level_scores.dim() != 2:
        raise InputError(f"expected shape [B, R], got {tuple(token_level_scores.shape)}",
                         key="token_level_scores")
    shape = token_level_scores.shape
    _check_float("old_log_probs", old_log_probs, shape)
    _check_float("ref_log_probs", ref_log_probs, shape)
    m = bool_mask(mask, shape)
    # Zero both log-probs under mask 0 first so no NaN/inf there reaches the estimator.
    old = torch.where(m, old_log_probs, 0.0)
    ref = torch.where(m, ref_log_probs, 0.0)
    kl = torch.where(m, kl_estimators.kl_penalty(old, ref, kl_penalty, k3_clamp=k3_clamp),
                     0.0)
    rewards = token_level_scores - float(kl_coef) * kl
    return rewards, kl


def kl_in_reward_metrics(kl: torch.Tensor, mask: torch.Tensor, *,
                         kl_coef: float) -> dict[str, float]:
    """Catalogued metrics of KL-in-reward (``rlaudit/metrics.py``).

    ``rollout/kl``: token-mean of ``kl`` over mask-1 tokens (denominator N_tok);
    ``actor/reward_kl_penalty``: token-mean of ``kl_coef * kl`` (same denominator).
    Both 0.0 when no token is valid.
    """
    m = bool_mask(mask, kl.shape)
    mean_kl = float(masked_mean(torch.where(m, kl, 0.0), m))
    return {"rollout/kl": mean_kl, "actor/reward_kl_penalty": float(kl_coef) * mean_kl}


def combine_reward_scores(per_function: torch.Tensor, weights, applied: torch.Tensor | None = None
                          ) -> torch.Tensor:
    """The combined score of several reward functions: each row's weighted sum over the functions
    that scored it (TRL's ``sum_then_normalize``: ``(rewards_per_func * reward_weights)
    .nansum(dim=1)``, a function that returned None being NaN there).

    Args:
        per_function: [B, F] float, function f's score of row i (read only where ``applied``).
        weights: F floats, one per function.
        applied: [B, F] bool, True where function f scored row i (None: everywhere).

    Returns:
        [B] float64 (new): ``sum_f weights[f] * per_function[i, f]`` over applied f; a row no
        function scored sums to 0 (callers refuse such rows: TRL zeroes their advantage).
    """
    _check_float("per_function", per_function)
    if per_function.dim() != 2:
        raise InputError(f"expected shape [B, F], got {tuple(per_function.shape)}",
                         key="per_function")
    w = torch.as_tensor(list(weights), dtype=torch.float64)
    if w.shape != (per_function.shape[1],):
        raise InputError(f"expected {per_function.shape[1]} weights (one per function), got "
                         f"{w.numel()}", key="weights")
    m = torch.ones_like(per_function, dtype=torch.bool) if applied is None else applied.bool()
    return torch.where(m, per_function.double() * w, 0.0).sum(1)


def reward_function_means(per_function: torch.Tensor, applied: torch.Tensor | None = None
                          ) -> list[float]:
    """Per function, the mean of its scores over the rows it scored (TRL's logged
    ``rewards/<func>/mean``: ``nanmean`` of its column); denominator: that function's count of
    scored rows (NaN for a function that scored none)."""
    m = (torch.ones_like(per_function, dtype=torch.bool) if applied is None
         else applied.bool())
    total = torch.where(m, per_function.double(), 0.0).sum(0)
    count = m.sum(0).double()
    return [float(t / c) if c else float("nan") for t, c in zip(total, count)]
