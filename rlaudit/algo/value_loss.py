"""Clipped value (critic) loss, per token.

PPO's value clipping (verl ``compute_value_loss``): the new prediction may not move the loss
below what it would be with the prediction clipped to within ``cliprange_value`` of the old
value; per token ``0.5 * max((v - G)^2, (clip(v, V_old - c, V_old + c) - G)^2)``. The caller
aggregates ``loss_mat`` with :func:`rlaudit.algo.agg.agg_loss` (``critic.loss_agg_mode``) and
``clipped`` with ``masked_mean`` (``critic/vf_clipfrac``, a token-mean).
"""

from __future__ import annotations

import torch

from rlaudit.algo.agg import bool_mask
from rlaudit.errors import InputError

__all__ = ["value_loss"]


def value_loss(vpreds: torch.Tensor, values: torch.Tensor, returns: torch.Tensor,
               mask: torch.Tensor, *, cliprange_value: float
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token clipped value loss.

    Args:
        vpreds: ``[B, R]`` the critic's current predictions (carries grad).
        values: ``[B, R]`` the critic's predictions at rollout time (the clip centre).
        returns: ``[B, R]`` regression targets.
        mask: ``[B, R]`` bool or 0/1, True/1 = the token counts. Inputs under mask 0 are
            replaced before any arithmetic (NaN there reaches neither value nor gradient).
        cliprange_value: ``c >= 0``, the half-width of the clip window around ``values``.
    Returns:
        ``(loss_mat, clipped)``, both ``[B, R]``: ``loss_mat = 0.5 * max(unclipped sq. error,
        clipped sq. error)`` (0 under mask 0; no reduction) and ``clipped`` (bool) = the clipped
        term was strictly larger (False under mask 0).
    """
    for key, t in (("values", values), ("returns", returns), ("mask", mask)):
        if not isinstance(t, torch.Tensor) or t.shape != vpreds.shape:
            raise InputError(f"expected a tensor of vpreds' shape {tuple(vpreds.shape)}, got "
                             f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t)}",
                             key=key)
    if not cliprange_value >= 0:
        raise InputError(f"must be >= 0, got {cliprange_value!r}", key="cliprange_value")
    m = bool_mask(mask, vpreds.shape)
    zero = torch.zeros_like(vpreds)
    v = torch.where(m, vpreds, zero)
    old = torch.where(m, values.to(vpreds.dtype), zero)
    ret = torch.where(m, returns.to(vpreds.dtype), zero)
    v_clipped = torch.clamp(v, old - cliprange_value, old + cliprange_value)
    loss_unclipped = (v - ret).square()
    loss_clipped = (v_clipped - ret).square()
    loss_mat = 0.5 * torch.maximum(loss_unclipped, loss_clipped)
    clipped = (loss_clipped > loss_unclipped) & m
    return torch.where(m, loss_mat, zero), clipped
