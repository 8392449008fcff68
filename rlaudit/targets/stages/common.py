"""Helpers more than one family of stage checks uses."""

from __future__ import annotations

from typing import Mapping

import torch

from rlaudit.targets.contract.guard import AdapterRaised


def grad_of(out: torch.Tensor, leaf: torch.Tensor, mask: torch.Tensor | None = None):
    """d(sum of ``out`` over ``mask``)/d``leaf`` (zeros when ``out`` does not depend on it)."""
    if not isinstance(out, torch.Tensor):
        raise AdapterRaised("the stage", TypeError(
            f"expected a differentiable tensor, got {type(out).__name__}"))
    total = out.sum() if mask is None else torch.where(mask, out, 0.0).sum()
    if not total.requires_grad:
        return torch.zeros_like(leaf)
    (g,) = torch.autograd.grad(total, leaf, allow_unused=True)
    return torch.zeros_like(leaf) if g is None else g


def same_mask(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Same valid positions (a micro-batch may be narrower or wider than the batch)."""
    w = min(got.shape[0], want.shape[0])
    return (torch.equal(got[:w].cpu(), want[:w]) and not bool(got[w:].any())
            and not bool(want[w:].any()))


def row_key(t: Mapping[str, torch.Tensor], i: int) -> tuple:
    """A row's identity: its prompt tokens and response tokens (the stage inputs give every row
    a distinct first prompt token, so ``uid`` need not travel with it)."""
    pl, rl = int(t["prompt_lengths"][i]), int(t["response_lengths"][i])
    return (tuple(t["prompt_ids"][i, :pl].tolist()), tuple(t["response_ids"][i, :rl].tolist()))
