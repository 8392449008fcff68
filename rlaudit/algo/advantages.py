"""Advantage estimators (verl's names and semantics): gae, grpo, drgrpo, rloo, reinforce_plus_plus,
reinforce_plus_plus_baseline.

Entry point::

    adv, returns = compute_advantages("grpo", token_level_rewards=r, response_mask=m, uid=uid)

Shapes: ``token_level_rewards``, ``response_mask``, ``values`` and both outputs are ``[B, R]``
(response-aligned, see ``rlaudit/data/batch.py``); ``uid`` is ``[B]`` int64, the group id (rows
sampled from one prompt share it). Rows of a group need not be contiguous; groups may be ragged
or singletons. ``response_mask`` True/1 = the token is an action of the policy and counts.

Conventions shared by every estimator:

- Outputs are exactly 0 where the mask is 0, detached, in the dtype of ``token_level_rewards``.
- Nothing under mask 0 is read: a reward or value placed on a mask-0 token is ignored (even
  NaN/inf).
- Outcome estimators (grpo, drgrpo, rloo, reinforce_plus_plus_baseline) score a row by the sum of
  its mask-1 token-level rewards, broadcast the row's advantage to its mask-1 tokens, and return
  ``returns == advantages`` (as verl does).
- Mask-0 tokens *inside* a response (e.g. tool output in multi-turn rollouts) are not actions:
  the temporal recursions of gae and reinforce_plus_plus skip them (no discount step, no reward,
  no value), carrying the running quantities over them. This is verl's GAE; verl's
  REINFORCE++ instead resets its running return at every mask-0 token, which for interior gaps
  drops the final reward from the tokens before the gap. Both agree on right-padded masks.
- Group statistics are vectorised (``torch.unique(return_inverse=True)`` + ``scatter_add``), so any
  int64 uid values work and the result is independent of row order.
"""

from __future__ import annotations

import functools
from typing import Callable

import torch

from rlaudit.algo.registry import Registry
from rlaudit.errors import InputError

GRPO_EPS = 1e-6
"""verl's epsilon in (score - mean) / (std + eps): a zero-variance group gets advantage 0
(``grpo_std_eps`` sets another: TRL's is 1e-4)."""

WHITEN_EPS = 1e-8
"""verl's masked_whiten: (x - mean) * rsqrt(var + eps); keeps an all-equal batch finite."""

OUTCOME_SCORES = ("masked-sum", "unmasked-sum")
"""How outcome estimators score a row: the sum of its mask-1 token-level rewards (rlaudit's
reference), or of every position's (verl's ``token_level_rewards.sum(dim=-1)``; a convention a
target can declare, see rlaudit.targets.Difference)."""

Estimator = Callable[..., tuple[torch.Tensor, torch.Tensor]]
ADV_ESTIMATORS: Registry[Estimator] = Registry("advantage estimator")


# ---- validation ------------------------------------------------------------------------------
def _check_inputs(token_level_rewards, response_mask, uid, values, *, need_values: bool):
    """Validate shapes/dtypes; return (rewards, mask as bool, uid, values)."""
    r = token_level_rewards
    if not isinstance(r, torch.Tensor) or r.dim() != 2 or not r.is_floating_point():
        raise InputError(f"expected a float tensor [B, R], got "
                         f"{getattr(r, 'dtype', type(r).__name__)} "
                         f"{tuple(getattr(r, 'shape', ()))}", key="token_level_rewards")
    b = r.shape[0]
    m = response_mask
    if not isinstance(m, torch.Tensor) or tuple(m.shape) != tuple(r.shape):
        raise InputError(f"expected shape {tuple(r.shape)} (as token_level_rewards), got "
                         f"{tuple(getattr(m, 'shape', ()))}", key="response_mask")
    if m.dtype != torch.bool:
        if m.numel() and not bool(((m == 0) | (m == 1)).all()):
            raise InputError("a non-bool mask must hold only 0 and 1", key="response_mask")
        m = m != 0
    if (not isinstance(uid, torch.Tensor) or uid.dim() != 1 or uid.shape[0] != b
            or uid.is_floating_point() or uid.is_complex() or uid.dtype == torch.bool):
        raise InputError(f"expected an integer tensor [B={b}], got "
                         f"{getattr(uid, 'dtype', type(uid).__name__)} "
                         f"{tuple(getattr(uid, 'shape', ()))}", key="uid")
    if need_values:
        if values is None:
            raise InputError("this estimator needs critic values [B, R]", key="values")
        if not isinstance(values, torch.Tensor) or tuple(values.shape) != tuple(r.shape):
            raise InputError(f"expected shape {tuple(r.shape)} (as token_level_rewards), got "
                             f"{tuple(getattr(values, 'shape', ()))}", key="values")
        if not values.is_floating_point():
            raise InputError(f"expected a float tensor, got {values.dtype}", key="values")
        values = values.to(r.dtype)
    return r, m, uid, values


def _estimator(name: str, *, needs_values: bool = False):
    """Register ``fn(rewards, mask, uid, values, gamma, lam, norm)`` under ``name`` behind the
    common public keyword signature, with input validation and no autograd."""

    def deco(fn):
        @functools.wraps(fn)
        def wrapper(*, token_level_rewards: torch.Tensor, response_mask: torch.Tensor,
                    uid: torch.Tensor, values: torch.Tensor | None = None, gamma: float = 1.0,
                    lam: float = 1.0, norm_adv_by_std_in_grpo: bool = True,
                    outcome_score: str = "masked-sum", grpo_std_eps: float = GRPO_EPS):
            r, m, u, v = _check_inputs(token_level_rewards, response_mask, uid, values,
                                       need_values=needs_values)
            if outcome_score not in OUTCOME_SCORES:
                raise InputError(f"expected one of {list(OUTCOME_SCORES)}, got "
                                 f"{outcome_score!r}", key="outcome_score")
            with torch.no_grad():
                return fn(r, m, u, v, float(gamma), float(lam), bool(norm_adv_by_std_in_grpo),
                          outcome_score, float(grpo_std_eps))

        ADV_ESTIMATORS.register(name)(wrapper)
        return wrapper

    return deco


def compute_advantages(name: str, *, token_level_rewards: torch.Tensor,
                       response_mask: torch.Tensor, uid: torch.Tensor,
                       values: torch.Tensor | None = None, gamma: float = 1.0, lam: float = 1.0,
                       norm_adv_by_std_in_grpo: bool = True,
                       outcome_score: str = "masked-sum", grpo_std_eps: float = GRPO_EPS
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """Run estimator ``name`` (see :data:`ADV_ESTIMATORS`); returns ``(advantages, returns)``,
    both ``[B, R]``, 0 where ``response_mask`` is 0. ``values`` is needed by ``gae`` only;
    ``gamma``/``lam`` are read by gae (both) and reinforce_plus_plus (gamma);
    ``norm_adv_by_std_in_grpo`` and ``grpo_std_eps`` by grpo only; ``outcome_score``
    (:data:`OUTCOME_SCORES`) by the outcome estimators. Unknown ``name`` raises
    ``UnknownNameError``."""
    fn = ADV_ESTIMATORS.get(name, key="algorithm.adv_estimator")
    return fn(token_level_rewards=token_level_rewards, response_mask=response_mask, uid=uid,
              values=values, gamma=gamma, lam=lam, norm_adv_by_std_in_grpo=norm_adv_by_std_in_grpo,
              outcome_score=outcome_score, grpo_std_eps=grpo_std_eps)


# ---- building blocks -------------------------------------------------------------------------
def _row_scores(rewards: torch.Tensor, mask: torch.Tensor, score: str) -> torch.Tensor:
    """[B]: sum of each row's mask-1 token-level rewards (mask-0 entries are never read); with
    ``score="unmasked-sum"`` the sum over every position (verl's outcome estimators)."""
    if score == "unmasked-sum":
        return rewards.sum(-1)
    return torch.where(mask, rewards, 0.0).sum(-1)


def _broadcast(per_row: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[B] -> [B, R]: the row's value on its mask-1 tokens, 0 elsewhere."""
    return torch.where(mask, per_row.unsqueeze(-1), 0.0)


def group_stats(uid: torch.Tensor, scores: torch.Tensor):
    """Per-row statistics of the row's group, vectorised over arbitrary int64 uids.

    Args: ``uid`` [B] int, ``scores`` [B] float.
    Returns ``(count, mean, std)``, each [B] (count as ``scores.dtype``): the group's size, its
    mean (denominator: group size) and its Bessel-corrected std (denominator: size - 1, as
    ``torch.std``; NaN-free: 0 for singleton groups, which callers special-case).
    """
    _, inv, counts = torch.unique(uid, return_inverse=True, return_counts=True)
    inv = inv.to(scores.device)
    n = counts.to(device=scores.device, dtype=scores.dtype)
    sums = torch.zeros(n.shape[0], dtype=scores.dtype, device=scores.device)
    mean_g = sums.scatter_add(0, inv, scores) / n
    dev = scores - mean_g[inv]
    ss = torch.zeros_like(sums).scatter_add(0, inv, dev * dev)
    std_g = torch.sqrt(ss / (n - 1).clamp(min=1))
    return n[inv], mean_g[inv], std_g[inv]


def masked_whiten(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """verl's masked_whiten over the whole batch: ``(x - mean) * rsqrt(var + WHITEN_EPS)``.

    ``x``, ``mask`` [B, R] (bool). mean: over mask-1 tokens (denominator N_tok); var: Bessel-
    corrected (denominator N_tok - 1). With N_tok <= 1 the centred values are 0 and the result is
    0 (verl raises there). Returns [B, R], 0 where mask is 0.
    """
    xm = torch.where(mask, x, 0.0)
    n = mask.sum()
    nf = n.to(x.dtype).clamp(min=1)
    mean = xm.sum() / nf
    centred = torch.where(mask, x - mean, 0.0)
    var = (centred * centred).sum() / (n.to(x.dtype) - 1).clamp(min=1)
    return torch.where(mask, centred * torch.rsqrt(var + WHITEN_EPS), 0.0)


def _discounted_scan(step, carry0, mask: torch.Tensor) -> torch.Tensor:
    """Run ``out_t, carry = step(t, carry)`` from t = R-1 down to 0, skipping mask-0 tokens
    (the carry passes over them unchanged). Returns [B, R] of ``out_t``, 0 where mask is 0."""
    cols = []
    carry = carry0
    for t in reversed(range(mask.shape[1])):
        m = mask[:, t]
        out_t, new_carry = step(t, carry)
        carry = tuple(torch.where(m, nc, c) for nc, c in zip(new_carry, carry))
        cols.append(torch.where(m, out_t, 0.0))
    if not cols:
        return torch.zeros(mask.shape, dtype=carry0[0].dtype, device=mask.device)
    return torch.stack(cols[::-1], dim=1)


# ---- estimators ------------------------------------------------------------------------------
@_estimator("gae", needs_values=True)
def gae(rewards, mask, uid, values, gamma, lam, norm, score, eps):
    """Generalised advantage estimation over mask-1 tokens (PPO with a critic).

    For the mask-1 tokens t_1 < ... < t_n of a row (mask-0 tokens skipped entirely):
    ``delta_k = r_{t_k} + gamma * V_{t_{k+1}} - V_{t_k}`` (V after the last token = 0),
    ``A_k = delta_k + gamma * lam * A_{k+1}``, ``returns = A + V`` (before whitening).
    Advantages are then whitened over the whole batch (:func:`masked_whiten`), as verl does.
    Reads ``values``, ``gamma``, ``lam``; ignores ``uid``.
    """
    zero = torch.zeros(rewards.shape[0], dtype=rewards.dtype, device=rewards.device)

    def step(t, carry):
        next_value, next_adv = carry
        a_t = rewards[:, t] + gamma * next_value - values[:, t] + gamma * lam * next_adv
        return a_t, (values[:, t], a_t)

    adv = _discounted_scan(step, (zero, zero), mask)
    returns = torch.where(mask, adv + values, 0.0)
    return masked_whiten(adv, mask), returns


@_estimator("grpo")
def grpo(rewards, mask, uid, values, gamma, lam, norm, score, eps):
    """GRPO: ``(score - group mean) / (group std + GRPO_EPS)`` (std Bessel-corrected as
    ``torch.std``); without the division when ``norm_adv_by_std_in_grpo`` is False. A singleton
    group uses mean 0 and std 1 (verl's convention), so its advantage is its own score
    (divided by 1 + GRPO_EPS when normalising). Returns ``(adv, adv)``."""
    adv = _broadcast(_grpo_scores(rewards, mask, uid, norm, score, eps), mask)
    return adv, adv.clone()


@_estimator("drgrpo")
def drgrpo(rewards, mask, uid, values, gamma, lam, norm, score, eps):
    """Dr.GRPO: GRPO's mean-centering without the std division, ``score - group mean``
    (``norm_adv_by_std_in_grpo`` is ignored; singleton: mean 0, advantage = score)."""
    adv = _broadcast(_grpo_scores(rewards, mask, uid, False, score, eps), mask)
    return adv, adv.clone()


def _grpo_scores(rewards, mask, uid, norm: bool, score: str, eps: float) -> torch.Tensor:
    """[B]: the GRPO advantage of each row (see :func:`grpo`)."""
    scores = _row_scores(rewards, mask, score)
    n, mean, std = group_stats(uid, scores)
    single = n == 1
    mean = torch.where(single, 0.0, mean)
    std = torch.where(single, 1.0, std)
    return (scores - mean) / (std + eps) if norm else scores - mean


@_estimator("rloo")
def rloo(rewards, mask, uid, values, gamma, lam, norm, score, eps):
    """RLOO: ``score - mean of the other rows' scores`` of the group, computed as
    ``n/(n-1) * (score - group mean)``. A singleton group has no other rows: advantage = score
    (verl's convention: baseline 0). Returns ``(adv, adv)``."""
    scores = _row_scores(rewards, mask, score)
    n, mean, _ = group_stats(uid, scores)
    adv = torch.where(n > 1, (scores - mean) * n / (n - 1).clamp(min=1), scores)
    adv = _broadcast(adv, mask)
    return adv, adv.clone()


@_estimator("reinforce_plus_plus")
def reinforce_plus_plus(rewards, mask, uid, values, gamma, lam, norm, score, eps):
    """REINFORCE++: discounted return-to-go over mask-1 tokens,
    ``G_k = r_{t_k} + gamma * G_{k+1}`` (mask-0 tokens skipped, see the module docstring);
    advantages = :func:`masked_whiten` of G over the batch; returns = G. Ignores ``uid``."""
    zero = torch.zeros(rewards.shape[0], dtype=rewards.dtype, device=rewards.device)

    def step(t, carry):
        g_t = rewards[:, t] + gamma * carry[0]
        return g_t, (g_t,)

    returns = _discounted_scan(step, (zero,), mask)
    return masked_whiten(returns, mask), returns


@_estimator("reinforce_plus_plus_baseline")
def reinforce_plus_plus_baseline(rewards, mask, uid, values, gamma, lam, norm, score, eps):
    """REINFORCE++ with a group baseline: ``score - group mean`` (singleton: mean 0), broadcast
    to the row's mask-1 tokens, then :func:`masked_whiten` over all mask-1 tokens of the batch
    (so longer responses weigh more in mean and variance, as in verl). Returns ``(adv, adv)``."""
    scores = _row_scores(rewards, mask, score)
    n, mean, _ = group_stats(uid, scores)
    centred = scores - torch.where(n == 1, 0.0, mean)
    adv = masked_whiten(_broadcast(centred, mask), mask)
    return adv, adv.clone()
