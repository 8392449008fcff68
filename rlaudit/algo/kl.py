"""Per-token KL estimators between the policy and a reference (or rollout) policy.

Each estimator maps the log-probs of the *sampled* tokens under the two policies to a per-token
estimate of ``KL(policy || ref)``; averaged over tokens sampled from the policy, k1 and k3 are
unbiased, k2 is biased but has low variance (Schulman, "Approximating KL divergence",
http://joschu.net/blog/kl-approx.html). Names are verl's (``actor.kl_loss_type``,
``algorithm.kl_penalty``):

- ``kl`` / ``k1``: ``logp - ref``
- ``abs``: ``|logp - ref|``
- ``mse`` / ``k2``: ``0.5 * (logp - ref)^2``
- ``low_var_kl`` / ``k3``: ``exp(ref - logp) - (ref - logp) - 1``, its value clamped at 10 as
  verl does (``k3_clamp="none"``: not, as TRL and others; a convention a target declares)
- ``k1+`` / ``kl+``: value of k1, gradient of k2 (straight-through)
- ``k3+`` / ``low_var_kl+``: value of k3, gradient of k2 (straight-through)

The estimate is returned per token, **unmasked**: the caller aggregates it with
:func:`rlaudit.algo.agg.agg_loss` (which ignores masked positions, whatever their values).
"""

from __future__ import annotations

from typing import Callable

import torch

from rlaudit.algo.registry import Registry
from rlaudit.errors import InputError

__all__ = ["KL_ESTIMATORS", "K3_CLAMPS", "DEFAULT_K3_CLAMP", "KL_LOSS_WEIGHTS", "kl_penalty",
           "k3_of_log_ratio"]

KLFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

#: Registry of per-token KL estimators ``fn(log_prob, ref_log_prob) -> [B, R]``.
KL_ESTIMATORS: Registry[KLFn] = Registry("KL estimator")

#: k3 clamps the log-ratio ``ref - logp`` to [-20, 20] before exp(): exp(20) ~ 4.9e8 stays finite
#: in float32, so one token with a huge log-prob gap cannot overflow to inf (verl's bound).
K3_LOG_RATIO_CLAMP = 20.0
#: k3 clamps its per-token value to [-10, 10] so that one outlier token cannot dominate the KL
#: loss (verl's bound; k3 >= 0, so in effect it caps at 10).
K3_VALUE_CLAMP = 10.0
#: how k3 treats large values (``algorithm.k3_clamp``): "value-10" clamps at K3_VALUE_CLAMP
#: (verl, rlaudit); "none" does not (TRL's beta term, textbook k3). Both keep the log-ratio
#: clamp at +-20, which only guards exp() against overflow (no trainer reaches it in practice).
K3_CLAMPS = ("value-10", "none")
DEFAULT_K3_CLAMP = K3_CLAMPS[0]      # rlaudit's own
#: what the actor's KL loss term is multiplied by per token (``actor.kl_loss_weight``): nothing
#: (verl, rlaudit), or the differentiable importance ratio pi / pi_old (TRL's default
#: ``use_bias_correction_kl``; :func:`rlaudit.algo.policy_loss.importance_ratio`)
KL_LOSS_WEIGHTS = ("none", "ratio")


@KL_ESTIMATORS.register("k1", "kl")
def k1(log_prob: torch.Tensor, ref_log_prob: torch.Tensor) -> torch.Tensor:
    """``logp - ref``: unbiased, can be negative per token."""
    return log_prob - ref_log_prob


@KL_ESTIMATORS.register("abs")
def kl_abs(log_prob: torch.Tensor, ref_log_prob: torch.Tensor) -> torch.Tensor:
    """``|logp - ref|``."""
    return (log_prob - ref_log_prob).abs()


@KL_ESTIMATORS.register("k2", "mse")
def k2(log_prob: torch.Tensor, ref_log_prob: torch.Tensor) -> torch.Tensor:
    """``0.5 * (logp - ref)^2``; its gradient w.r.t. ``logp`` is ``logp - ref``."""
    return 0.5 * (log_prob - ref_log_prob).square()


def k3_of_log_ratio(d: torch.Tensor) -> torch.Tensor:
    """``exp(d) - d - 1`` of a log-ratio ``d``, elementwise, no clamps: non-negative
    (``e^d >= 1 + d``), 0 exactly at ``d = 0``. Computed as ``expm1(d) - d``, the same value
    without the cancellation that makes ``exp(d) - d - 1`` round to small negatives (-1e-16 in
    float64 at ``d = 1e-8``)."""
    return torch.expm1(d) - d


def k3_unclamped(log_prob: torch.Tensor, ref_log_prob: torch.Tensor) -> torch.Tensor:
    """k3 without the value clamp (``k3_clamp="none"``): :func:`k3_of_log_ratio` of
    ``d = clamp(ref - logp, +-20)``."""
    d = (ref_log_prob - log_prob).clamp(-K3_LOG_RATIO_CLAMP, K3_LOG_RATIO_CLAMP)
    return k3_of_log_ratio(d)


@KL_ESTIMATORS.register("k3", "low_var_kl")
def k3(log_prob: torch.Tensor, ref_log_prob: torch.Tensor) -> torch.Tensor:
    """:func:`k3_of_log_ratio` of ``d = clamp(ref - logp, +-20)``, clamped to ``[-10, 10]``.

    Non-negative; 0 exactly where ``logp == ref``.
    """
    return k3_unclamped(log_prob, ref_log_prob).clamp(-K3_VALUE_CLAMP, K3_VALUE_CLAMP)


def _straight_through(value_fn: KLFn) -> KLFn:
    """Forward value of ``value_fn``, gradient of k2: ``value.detach() + k2 - k2.detach()``."""

    def fn(log_prob: torch.Tensor, ref_log_prob: torch.Tensor) -> torch.Tensor:
        grad_path = k2(log_prob, ref_log_prob)
        return value_fn(log_prob, ref_log_prob).detach() + (grad_path - grad_path.detach())

    fn.__name__ = f"{value_fn.__name__}_plus"
    fn.__doc__ = f"Value of {value_fn.__name__}, gradient of k2 (straight-through estimator)."
    return fn


KL_ESTIMATORS.register("k1+", "kl+")(_straight_through(k1))
KL_ESTIMATORS.register("k3+", "low_var_kl+")(_straight_through(k3))


#: canonical k3 names -> their estimator under ``k3_clamp="none"``
_UNCLAMPED = {"k3": k3_unclamped, "k3+": _straight_through(k3_unclamped)}


def kl_penalty(log_prob: torch.Tensor, ref_log_prob: torch.Tensor, kind: str, *,
               k3_clamp: str = DEFAULT_K3_CLAMP) -> torch.Tensor:
    """Per-token KL estimate of the policy against a reference.

    Args:
        log_prob: ``[B, R]`` log-probs of the sampled tokens under the policy (may carry grad).
        ref_log_prob: ``[B, R]`` log-probs of the same tokens under the reference (or rollout)
            policy; same shape.
        kind: a name in :data:`KL_ESTIMATORS` (``"k1"``, ``"k3"``, ``"low_var_kl+"``, ...).
        k3_clamp: one of :data:`K3_CLAMPS` (k3 / k3+ only: whether its value is clamped at 10).
    Returns:
        ``[B, R]`` per-token estimate, a new tensor (no reduction, no mask: positions outside the
        response mask hold whatever their inputs give; aggregate with ``agg_loss``).
    Raises:
        UnknownNameError: ``kind`` is not registered.
        InputError: the shapes differ.
    """
    fn = KL_ESTIMATORS.get(kind, key="kind")
    if k3_clamp not in K3_CLAMPS:
        raise InputError(f"expected one of {list(K3_CLAMPS)}, got {k3_clamp!r}", key="k3_clamp")
    if k3_clamp == "none":
        fn = _UNCLAMPED.get(KL_ESTIMATORS.canonical(kind), fn)
    if log_prob.shape != ref_log_prob.shape:
        raise InputError(f"shape {tuple(ref_log_prob.shape)} must equal log_prob's shape "
                         f"{tuple(log_prob.shape)}", key="ref_log_prob")
    return fn(log_prob, ref_log_prob)
