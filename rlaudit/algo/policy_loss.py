"""Per-token policy-gradient losses: PPO clip with dual clip ("vanilla"), GSPO and CISPO.

``compute_policy_loss(name, ...)`` returns a :class:`PolicyLossOutput` of per-token ``[B, R]``
tensors; the caller aggregates ``loss_mat`` with :func:`rlaudit.algo.agg.agg_loss`
(``actor.loss_agg_mode``) and the flags/ratios with ``masked_mean`` for the metrics
``actor/pg_clipfrac``, ``actor/pg_clipfrac_lower`` and ``actor/ppo_kl`` (token-means).

Names are verl's (``actor.policy_loss.loss_mode``). GRPO and DAPO use "vanilla": they differ in
config (symmetric vs. decoupled ``clip_ratio_low/high``), not in code.

GSPO's gradient comes in two forms (``gspo_gradient``, a declarable convention): GSPO-token's
(``"per-token"``, verl's and rlaudit's: each token's term differentiates its own log-prob) and
GSPO's sequence-level one (``"sequence"``, slime's and TRL's: the gradient flows through the
sequence mean, so each token's term moves every token of its row). Values are the same; so are
the gradients when a row's advantages are equal (outcome advantages).

Masked positions (``mask`` False/0) never matter: inputs there are replaced (``torch.where``)
before any arithmetic, so NaN/inf in them reach neither values nor gradients. Outputs there are
0 (``loss_mat``, ``ppo_kl_mat``), 1 (``ratio``) and False (flags).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from rlaudit.algo.agg import bool_mask
from rlaudit.algo.registry import Registry
from rlaudit.errors import InputError

__all__ = ["GSPO_GRADIENTS", "POLICY_LOSSES", "PolicyLossOutput", "compute_policy_loss",
           "importance_ratio"]

#: how GSPO's sequence ratio is differentiated: GSPO-token's per-token form, or through the mean
GSPO_GRADIENTS = ("per-token", "sequence")

#: The log-ratio log(pi/pi_old) is clamped to [-20, 20] before exp(): exp(20) ~ 4.9e8 is finite
#: in float32, so a token whose log-prob moved absurdly cannot make the loss inf (verl's bound).
LOG_RATIO_CLAMP = 20.0


@dataclass(frozen=True)
class PolicyLossOutput:
    """Per-token results, all ``[B, R]``; entries under mask 0 are 0 / 1 (ratio) / False.

    Attributes:
        loss_mat: per-token loss to minimise (carries grad); aggregate with ``agg_loss``.
        clipped: bool, the clip was active (vanilla/gspo: the clipped surrogate was the larger
            loss; cispo: the importance weight was truncated). Token-mean -> ``pg_clipfrac``.
        clipped_lower: bool, the dual clip capped the loss (vanilla, ``A < 0`` only; always False
            for gspo/cispo). Token-mean -> ``pg_clipfrac_lower``.
        ratio: importance ratio used per token (gspo: the row's sequence ratio), detached.
        ppo_kl_mat: ``old_log_prob - log_prob`` (log-ratio clamped to +-20), detached.
            Token-mean -> ``actor/ppo_kl``.
    """

    loss_mat: torch.Tensor
    clipped: torch.Tensor
    clipped_lower: torch.Tensor
    ratio: torch.Tensor
    ppo_kl_mat: torch.Tensor


@dataclass(frozen=True)
class _Inputs:
    """Sanitised inputs: values under mask 0 replaced by 0 (log-probs, advantages)."""

    old: torch.Tensor
    logp: torch.Tensor
    adv: torch.Tensor
    mask: torch.Tensor        # bool
    low: float
    high: float
    c: float
    gspo_gradient: str = "per-token"


PolicyLossFn = Callable[[_Inputs], PolicyLossOutput]

#: Registry of policy losses; each takes the sanitised inputs and returns a PolicyLossOutput.
POLICY_LOSSES: Registry[PolicyLossFn] = Registry("policy loss")


def _log_ratio(x: _Inputs) -> torch.Tensor:
    return (x.logp - x.old).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


def _sequence_log_ratio(logp: torch.Tensor, old: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """``[B]``: each row's mean of ``logp - old`` over its valid tokens (1 if none); the inputs
    are 0 under the mask (sanitised), so the sum runs over valid tokens only."""
    n_i = m.sum(dim=-1).clamp(min=1).to(logp.dtype)
    return (logp - old).sum(dim=-1) / n_i


def _finish(x: _Inputs, loss, clipped, clipped_lower, ratio, log_ratio) -> PolicyLossOutput:
    m = x.mask
    return PolicyLossOutput(
        loss_mat=torch.where(m, loss, torch.zeros_like(loss)),
        clipped=clipped & m,
        clipped_lower=clipped_lower & m,
        ratio=torch.where(m, ratio.detach(), torch.ones_like(ratio)),
        ppo_kl_mat=torch.where(m, -log_ratio.detach(), torch.zeros_like(log_ratio)),
    )


def _clipped_surrogate(adv, ratio, low, high):
    """``max(-A r, -A clip(r, 1-low, 1+high))`` and whether the clipped term was larger."""
    l1 = -adv * ratio
    l2 = -adv * ratio.clamp(1.0 - low, 1.0 + high)
    return torch.maximum(l1, l2), l2 > l1


@POLICY_LOSSES.register("vanilla")
def _vanilla(x: _Inputs) -> PolicyLossOutput:
    """PPO clip, asymmetric ``(1-low, 1+high)``, plus dual clip: for ``A < 0`` the loss is
    capped at ``-A * c`` (Ye et al. 2020, "Mastering Complex Control in MOBA Games")."""
    log_ratio = _log_ratio(x)
    ratio = torch.exp(log_ratio)
    loss_clip, clipped = _clipped_surrogate(x.adv, ratio, x.low, x.high)
    cap = -x.adv * x.c
    negative = x.adv < 0
    loss = torch.where(negative, torch.minimum(loss_clip, cap), loss_clip)
    clipped_lower = negative & (loss_clip > cap)
    return _finish(x, loss, clipped, clipped_lower, ratio, log_ratio)


@POLICY_LOSSES.register("gspo")
def _gspo(x: _Inputs) -> PolicyLossOutput:
    """GSPO-token (Zheng et al. 2025, arXiv:2507.18071): the sequence ratio
    ``s_i = exp(mean_{valid t} (logp - old))`` is given to every token of row i as
    ``sg[s_i] * pi / sg[pi]`` (value ``s_i``, gradient ``s_i * d logp_t``), then PPO-clipped
    with ``(1-low, 1+high)``. The mean's denominator is the row's valid tokens (1 if none).
    No dual clip. With ``gspo_gradient="sequence"`` (GSPO, eq. 7) every token of row i gets
    ``s_i`` itself, differentiated through the mean: gradient ``s_i * d logp_t' / n_i`` for
    every valid ``t'`` of the row."""
    seq_log_ratio = _sequence_log_ratio(x.logp, x.old, x.mask)
    if x.gspo_gradient == "sequence":
        log_s = seq_log_ratio.unsqueeze(-1).expand_as(x.logp)
    else:
        # The detached sequence term is added last (verl#2775: adding a large term to a small
        # difference first loses precision).
        log_s = (x.logp - x.logp.detach() + seq_log_ratio.detach().unsqueeze(-1))
    log_s = log_s.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.exp(log_s)
    loss, clipped = _clipped_surrogate(x.adv, ratio, x.low, x.high)
    return _finish(x, loss, clipped, torch.zeros_like(clipped), ratio, _log_ratio(x))


@POLICY_LOSSES.register("cispo")
def _cispo(x: _Inputs) -> PolicyLossOutput:
    """CISPO (MiniMax-M1, arXiv:2506.13585): ``-sg[clip(r, 1-low, 1+high)] * A * logp``.
    Every token keeps a gradient (``-clip(r) * A * d logp``); ``clipped`` = r outside the band."""
    log_ratio = _log_ratio(x)
    ratio = torch.exp(log_ratio)
    weight = ratio.clamp(1.0 - x.low, 1.0 + x.high).detach()
    loss = -weight * x.adv * x.logp
    clipped = (ratio < 1.0 - x.low) | (ratio > 1.0 + x.high)
    return _finish(x, loss, clipped, torch.zeros_like(clipped), ratio, log_ratio)


def _check(name: str, t: torch.Tensor, shape: torch.Size | None) -> None:
    if not isinstance(t, torch.Tensor):
        raise InputError(f"expected a tensor [B, R], got {type(t).__name__}", key=name)
    if shape is not None and t.shape != shape:
        raise InputError(f"shape {tuple(t.shape)} must equal log_prob's shape {tuple(shape)}",
                         key=name)


def compute_policy_loss(name: str, *, old_log_prob: torch.Tensor, log_prob: torch.Tensor,
                        advantages: torch.Tensor, mask: torch.Tensor, clip_ratio_low: float,
                        clip_ratio_high: float, clip_ratio_c: float,
                        gspo_gradient: str = "per-token") -> PolicyLossOutput:
    """Per-token policy loss ``name`` (a key of :data:`POLICY_LOSSES`).

    Args:
        old_log_prob: ``[B, R]`` log-probs of the sampled tokens under the behaviour policy
            (the policy before this update); no gradient expected.
        log_prob: ``[B, R]`` log-probs under the current policy (carries grad).
        advantages: ``[B, R]`` per-token advantages.
        mask: ``[B, R]`` bool or 0/1, True/1 = the token counts (response mask).
        clip_ratio_low / clip_ratio_high: clip epsilons, ratio kept in ``[1-low, 1+high]``.
        clip_ratio_c: dual-clip bound (> 1), vanilla only.
        gspo_gradient: :data:`GSPO_GRADIENTS`, gspo only (see the module docstring).
    Returns:
        :class:`PolicyLossOutput` (no reduction here: every field is ``[B, R]``).
    """
    fn = POLICY_LOSSES.get(name, key="name")
    _check("log_prob", log_prob, None)
    for key, t in (("old_log_prob", old_log_prob), ("advantages", advantages), ("mask", mask)):
        _check(key, t, log_prob.shape)
    for key, v in (("clip_ratio_low", clip_ratio_low), ("clip_ratio_high", clip_ratio_high)):
        if not v >= 0:
            raise InputError(f"must be >= 0, got {v!r}", key=key)
    if gspo_gradient not in GSPO_GRADIENTS:
        raise InputError(f"expected one of {list(GSPO_GRADIENTS)}, got {gspo_gradient!r}",
                         key="gspo_gradient")
    if not clip_ratio_c > 1:
        raise InputError(f"dual-clip bound must be > 1, got {clip_ratio_c!r}", key="clip_ratio_c")
    m = bool_mask(mask, log_prob.shape)
    zero = torch.zeros_like(log_prob)
    x = _Inputs(
        old=torch.where(m, old_log_prob.to(log_prob.dtype), zero),
        logp=torch.where(m, log_prob, zero),
        adv=torch.where(m, advantages.to(log_prob.dtype), zero),
        mask=m, low=float(clip_ratio_low), high=float(clip_ratio_high), c=float(clip_ratio_c),
        gspo_gradient=gspo_gradient)
    return fn(x)


def importance_ratio(log_prob: torch.Tensor, old_log_prob: torch.Tensor, mask: torch.Tensor, *,
                     sequence: bool = False) -> torch.Tensor:
    """The importance ratio ``pi / pi_old`` a KL loss term is multiplied by under
    ``kl_loss_weight="ratio"`` (TRL's ``use_bias_correction_kl``, DeepSeek-V3.2): differentiable,
    so with k3 each token's gradient becomes ``ratio * (logp - ref) * d logp``, the unbiased
    gradient of the reverse KL when tokens were sampled from pi_old -- where the ratio's value
    is 1 its gradient still counts.

    Token level: ``exp(logp - old)`` per token. ``sequence`` (GSPO's level): every token of row
    i gets ``exp`` of the row's mean log-ratio over its valid tokens (GSPO's sequence ratio),
    differentiated through that mean (as TRL's ``importance_sampling_level="sequence"``). The
    log-ratio is clamped to +-LOG_RATIO_CLAMP before exp(), as in the policy losses. Masked
    positions get 1 (their inputs never reach the result).

    Returns:
        ``[B, R]``, the dtype of ``log_prob``.
    """
    _check("log_prob", log_prob, None)
    for key, t in (("old_log_prob", old_log_prob), ("mask", mask)):
        _check(key, t, log_prob.shape)
    m = bool_mask(mask, log_prob.shape)
    zero = torch.zeros_like(log_prob)
    logp = torch.where(m, log_prob, zero)
    old = torch.where(m, old_log_prob.detach().to(log_prob.dtype), zero)
    log_ratio = (_sequence_log_ratio(logp, old, m).unsqueeze(-1).expand_as(logp) if sequence
                 else logp - old)
    ratio = torch.exp(log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    return torch.where(m, ratio, torch.ones_like(ratio))
