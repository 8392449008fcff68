"""Rollout correction: the sampling engine (e.g. vLLM) and the trainer compute slightly different
log-probs for the same tokens. This module measures and corrects that mismatch.

- :func:`rollout_is_weights`: importance weights ``pi_train / pi_rollout`` per token, per
  sequence (product of token ratios) or per sequence as a geometric mean, truncated (TIS) or
  masked (MIS) at thresholds, multiplied into the policy loss (verl's rollout correction; the
  names are verl's, see :data:`LEVELS`).
- :func:`rollout_kl_loss_mat`: a penalty on current-vs-rollout drift (SkyRL PR #1811's rollout KL
  loss; ``k2`` = 0.5 * (log_prob - rollout_log_prob)^2 by default).
- :func:`mismatch_metrics`, :func:`is_metrics`: the catalogued ``rollout_corr/*`` metrics.

Shapes: every per-token tensor is ``[B, R]``; ``mask`` is ``[B, R]`` bool or 0/1, True = the
token counts. Values under mask 0 are never read (NaN/inf there does not leak).
"""

from __future__ import annotations

import math
import torch

from rlaudit.algo.agg import bool_mask, masked_max, masked_mean
from rlaudit.algo.kl import DEFAULT_K3_CLAMP, k3_of_log_ratio, kl_penalty
from rlaudit.errors import InputError

MAX_LOG_RATIO = 20.0
"""Clamp log importance ratios to [-20, 20] before exp() so a large mismatch cannot overflow
(e^20 ~ 4.9e8) or underflow (verl's SAFETY_BOUND)."""

LEVELS = ("token", "sequence", "geometric")
"""Aggregation levels of the IS weight, by verl's names (``rollout_is`` in verl 0.6.1+, which
keeps token and sequence; ``rollout_is_level`` in verl 0.6.0, which also had geometric)."""
MODES = ("truncate", "mask")
"""What a weight outside the thresholds becomes: ``truncate`` (TIS): capped at the upper
threshold; ``mask`` (MIS, verl 0.6.0's ``rollout_is_mode: mask``): 0 when outside
``[lower, upper]``."""


def _check_pair(a: torch.Tensor, b: torch.Tensor, names: tuple[str, str]) -> None:
    for t, name in zip((a, b), names):
        if not isinstance(t, torch.Tensor) or not t.is_floating_point() or t.dim() != 2:
            raise InputError(f"expected a float tensor [B, R], got "
                             f"{getattr(t, 'dtype', type(t).__name__)} "
                             f"{tuple(getattr(t, 'shape', ()))}", key=name)
    if a.shape != b.shape:
        raise InputError(f"expected shape {tuple(a.shape)} (as {names[0]}), got {tuple(b.shape)}",
                         key=names[1])


def is_log_weights(old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor,
                   mask: torch.Tensor, *, level: str) -> torch.Tensor:
    """Log importance weight of every valid token, before clamping or thresholds: [B, R].

    With ``d[i, t] = old[i, t] - rollout[i, t]`` on mask-1 tokens and ``n_i`` row i's mask-1
    tokens: ``token``: ``d[i, t]``; ``sequence``: ``sum_t d[i, t]`` (log of the product of the
    token ratios, the same for every token of the row); ``geometric``: ``sum_t d[i, t] / n_i``
    (log of their geometric mean: the length-normalised log-ratio). 0 where mask is 0.
    """
    _check_pair(old_log_probs, rollout_log_probs, ("old_log_probs", "rollout_log_probs"))
    m = bool_mask(mask, old_log_probs.shape)
    if level not in LEVELS:
        raise InputError(f"expected one of {', '.join(LEVELS)}, got {level!r}",
                         key="actor.rollout_correction.rollout_is")
    d = torch.where(m, old_log_probs.detach() - rollout_log_probs.detach(), 0.0)
    if level == "token":
        return d
    row = d.sum(-1, keepdim=True)
    if level == "geometric":
        row = row / m.sum(-1, keepdim=True).clamp(min=1).to(d.dtype)
    return torch.where(m, row, 0.0)


def rollout_is_weights(old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor,
                       mask: torch.Tensor, *, level: str, threshold: float | None,
                       mode: str = "truncate", threshold_lower: float | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """Rollout importance weights ``pi_train / pi_rollout``, truncated (TIS) or masked (MIS).

    ``w = exp(clamp(is_log_weights(...), -MAX_LOG_RATIO, MAX_LOG_RATIO))`` per token at
    ``level`` (token; sequence = product of the row's token ratios; geometric = their geometric
    mean), then, unless ``threshold`` is None:
    ``mode="truncate"``: ``min(w, threshold)``; ``mode="mask"``: 0 where ``w > threshold`` or
    ``w < threshold_lower`` (default ``1 / threshold``), as verl does.

    Args:
        old_log_probs: [B, R] trainer log-probs of the sampled tokens (before the update).
        rollout_log_probs: [B, R] the sampling engine's log-probs of the same tokens.
        mask: [B, R] bool or 0/1; True = the token counts.
        level: one of :data:`LEVELS`.
        threshold: upper bound (> 0) or None (no bound; ``mode="mask"`` then needs one).
        mode: one of :data:`MODES`.
        threshold_lower: lower bound of ``mode="mask"`` (0 < lower <= threshold).

    Returns:
        ``(weights, outside)``: weights [B, R] (detached, dtype of ``old_log_probs``, 0 where mask
        is 0; exactly 1 where the log-probs agree); outside [B, R] bool, True on mask-1 tokens
        whose (token's or row's) weight was outside the bounds (truncated or masked).
    """
    if mode not in MODES:
        raise InputError(f"expected one of {', '.join(MODES)}, got {mode!r}",
                         key="actor.rollout_correction.rollout_is_mode")
    if threshold is not None and not float(threshold) > 0:
        raise InputError(f"expected a threshold > 0, got {threshold}",
                         key="actor.rollout_correction.rollout_is_threshold")
    if mode == "mask" and threshold is None:
        raise InputError("rollout_is_mode mask needs a rollout_is_threshold",
                         key="actor.rollout_correction.rollout_is_threshold")
    lower = None
    if mode == "mask":
        lower = 1.0 / float(threshold) if threshold_lower is None else float(threshold_lower)
        if not 0 < lower <= float(threshold):
            raise InputError(f"expected 0 < threshold_lower <= threshold ({threshold}), got "
                             f"{threshold_lower}",
                             key="actor.rollout_correction.rollout_is_threshold_lower")
    with torch.no_grad():
        log_w = is_log_weights(old_log_probs, rollout_log_probs, mask, level=level)
        m = bool_mask(mask, old_log_probs.shape)
        if threshold is None:
            outside = torch.zeros_like(m)
        else:
            outside = m & (log_w > math.log(float(threshold)))
            if lower is not None:
                outside = outside | (m & (log_w < math.log(lower)))
        weights = torch.exp(log_w.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO))
        if threshold is not None:
            cut = 0.0 if mode == "mask" else float(threshold)
            weights = torch.where(outside, cut, weights)
        weights = torch.where(m, weights, 0.0)
    return weights, outside


def rollout_kl_loss_mat(log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, kind: str,
                        *, mask: torch.Tensor | None = None,
                        k3_clamp: str = DEFAULT_K3_CLAMP) -> torch.Tensor:
    """Per-token rollout KL loss: ``kl_penalty(log_probs, rollout_log_probs, kind)``, i.e. the KL
    estimator with the rollout engine's log-probs in the reference's place (k1: lp - rlp,
    k2: 0.5 (lp - rlp)^2, k3: exp(rlp - lp) - (rlp - lp) - 1, ...).

    Args:
        log_probs: [B, R] current policy log-probs (carry the gradient).
        rollout_log_probs: [B, R] the sampling engine's log-probs (no gradient expected).
        kind: a :data:`rlaudit.algo.kl.KL_ESTIMATORS` name
            (``actor.rollout_correction.rollout_kl_loss_type``).
        mask: optional [B, R]; if given the result is 0 where mask is 0 and neither value nor
            gradient depends on entries there.
        k3_clamp: k3's value clamp (``algorithm.k3_clamp``).

    Returns: ``loss_mat`` [B, R], to be reduced with ``agg_loss`` and the batch's denominators.
    """
    _check_pair(log_probs, rollout_log_probs, ("log_probs", "rollout_log_probs"))
    if mask is None:
        return kl_penalty(log_probs, rollout_log_probs, kind, k3_clamp=k3_clamp)
    m = bool_mask(mask, log_probs.shape)
    lp = torch.where(m, log_probs, 0.0)
    rlp = torch.where(m, rollout_log_probs, 0.0)
    return torch.where(m, kl_penalty(lp, rlp, kind, k3_clamp=k3_clamp), 0.0)


def mismatch_metrics(old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor,
                     mask: torch.Tensor) -> dict[str, float]:
    """Train-vs-rollout mismatch metrics (catalogue names, ``rlaudit/metrics.py``).

    With ``d = old_log_probs - rollout_log_probs`` on mask-1 tokens:

    - ``rollout_corr/kl``: token-mean of ``-d`` = rollout - old (k1 estimate of
      KL(rollout || train), samples from the rollout). Denominator N_tok.
    - ``rollout_corr/k3_kl``: token-mean of ``exp(d) - d - 1`` (k3 estimate of the same KL, >= 0;
      ``d`` clamped above at ``MAX_LOG_RATIO`` so exp cannot overflow, no value clamp).
      Denominator N_tok.
    - ``rollout_corr/log_ppl_diff``: mean over rows with >= 1 mask-1 token of
      ``mean_t rollout - mean_t old`` (per-row means over the row's mask-1 tokens), which is
      ``train log-ppl - rollout log-ppl`` with log-ppl = -mean log-prob; positive = the trainer
      finds the samples less likely than the engine did. Denominator: number of such rows.
    - ``rollout_corr/max_abs_log_prob_diff``: max of ``|d|`` over mask-1 tokens.

    Every value is 0.0 when no token is valid. Args: [B, R] each; mask bool or 0/1.
    """
    _check_pair(old_log_probs, rollout_log_probs, ("old_log_probs", "rollout_log_probs"))
    m = bool_mask(mask, old_log_probs.shape)
    with torch.no_grad():
        old = torch.where(m, old_log_probs.detach(), 0.0)
        rollout = torch.where(m, rollout_log_probs.detach(), 0.0)
        d = old - rollout
        # Not kl_penalty's k3: its value clamp (a loss safeguard) would hide a large mismatch.
        k3 = k3_of_log_ratio(d.clamp(max=MAX_LOG_RATIO))
        n_row = m.sum(-1)
        has = n_row > 0
        row_diff = (rollout - old).sum(-1) / n_row.clamp(min=1).to(d.dtype)
        n_has = int(has.sum())
        return {
            "rollout_corr/kl": float(masked_mean(-d, m)),
            "rollout_corr/k3_kl": float(masked_mean(k3, m)),
            "rollout_corr/log_ppl_diff":
                float(torch.where(has, row_diff, 0.0).sum() / n_has) if n_has else 0.0,
            "rollout_corr/max_abs_log_prob_diff": float(masked_max(d.abs(), m)),
        }


def is_metrics(weights: torch.Tensor, truncated: torch.Tensor, mask: torch.Tensor, *,
               level: str) -> dict[str, float]:
    """``rollout_corr/is_weight_mean`` (token-mean of ``weights``, denominator N_tok) and
    ``rollout_corr/is_clipfrac`` (token level: truncated/masked mask-1 tokens / N_tok; sequence
    and geometric levels: such rows / rows with >= 1 mask-1 token). Inputs as returned by
    :func:`rollout_is_weights`; 0.0 when nothing is valid."""
    m = bool_mask(mask, weights.shape)
    if tuple(truncated.shape) != tuple(weights.shape) or truncated.dtype != torch.bool:
        raise InputError(f"expected a bool tensor of shape {tuple(weights.shape)}, got "
                         f"{truncated.dtype} {tuple(truncated.shape)}", key="truncated")
    if level not in LEVELS:
        raise InputError(f"expected one of {', '.join(LEVELS)}, got {level!r}", key="level")
    with torch.no_grad():
        t = truncated & m
        if level == "token":
            clipfrac = float(masked_mean(t.to(torch.float64), m))
        else:
            rows = m.any(-1)
            n_rows = int(rows.sum())
            clipfrac = float((t.any(-1) & rows).sum()) / n_rows if n_rows else 0.0
        return {"rollout_corr/is_weight_mean": float(masked_mean(weights.detach(), m)),
                "rollout_corr/is_clipfrac": clipfrac}
