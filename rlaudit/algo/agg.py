"""Loss aggregation (``loss_agg_mode``) with global denominators, and masked reductions.

``agg_loss(loss_mat, mask, mode)`` reduces a per-token ``[B, R]`` loss to a scalar. Given
:class:`Denominators` counted over a *whole* mini-batch (all micro-batches, all data-parallel
ranks), each micro-batch returns its *contribution*, and contributions sum exactly to the
whole-batch value (docs/internals.md, "Loss aggregation and global denominators"):

======================== ============================================ ===================
mode                     whole-batch value                            denominator
======================== ============================================ ===================
token-mean               sum_it l*m / N_tok                           N_tok
seq-mean-token-sum       sum_i (sum_t l*m) / N_seq                    N_seq
seq-mean-token-mean      sum_i (sum_t l*m / n_i) / N_seq              n_i, then N_seq
seq-mean-token-sum-norm  sum_i (sum_t l*m) / (N_seq * L)              N_seq * L
======================== ============================================ ===================

``N_tok``: mask-True tokens; ``N_seq``: rows with at least one mask-True token (or, with
``seq_count="all-rows"``, every row: SkyRL's, slime's and TRL's convention); ``n_i``: row i's
mask-True tokens (always local: a row is never split); ``L``: a constant length
(``actor.loss_scale_factor`` or the batch's response width R).

Masked positions never matter: they are selected away with ``torch.where`` (not multiplied by
0), so NaN/inf there reach neither the value nor the gradient. A denominator of 0 (no valid
token) gives 0, never NaN, and the result stays connected to ``loss_mat``'s graph so that a
padding micro-batch can still call ``backward()`` (its gradient is 0).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from rlaudit.algo.registry import Registry
from rlaudit.errors import InputError

__all__ = ["AGG_MODES", "Denominators", "agg_loss", "masked_sum", "masked_mean", "masked_max",
           "masked_min"]


#: what N_seq counts: rows with at least one valid token (rlaudit, verl), or every row
SEQ_COUNTS = ("valid-rows", "all-rows")


@dataclass(frozen=True)
class Denominators:
    """The counts ``agg_loss`` divides by; sum them over micro-batches/ranks for global ones.

    Attributes:
        tokens: ``N_tok``, number of mask-True tokens.
        seqs: ``N_seq``, number of rows with at least one mask-True token.
        norm_len: ``L``, the constant length of ``seq-mean-token-sum-norm``.
    """

    tokens: float
    seqs: float
    norm_len: float

    @classmethod
    def of(cls, mask: torch.Tensor, norm_len: float | None = None, *,
           seq_count: str = "valid-rows") -> "Denominators":
        """Local counts of ``mask`` (``[B, R]``, bool or 0/1; True/1 = the token counts).

        ``norm_len`` defaults to ``mask.shape[-1]`` (R). For global denominators pass the
        whole batch's width (or ``loss_scale_factor``), never a micro-batch's padded width.
        ``seq_count`` (:data:`SEQ_COUNTS`): ``N_seq`` counts rows with a valid token, or every
        row.
        """
        m = bool_mask(mask)
        if norm_len is None:
            norm_len = m.shape[-1]
        if not norm_len > 0:
            raise InputError(f"must be > 0, got {norm_len!r}", key="norm_len")
        if seq_count not in SEQ_COUNTS:
            raise InputError(f"expected one of {list(SEQ_COUNTS)}, got {seq_count!r}",
                             key="seq_count")
        seqs = m.any(dim=-1).sum() if seq_count == "valid-rows" else m.shape[0]
        return cls(tokens=float(m.sum()), seqs=float(seqs), norm_len=float(norm_len))

    def __add__(self, other: "Denominators") -> "Denominators":
        """Counts of the union of two disjoint sets of rows (they must share ``norm_len``)."""
        if not isinstance(other, Denominators):
            return NotImplemented
        if self.norm_len != other.norm_len:
            raise InputError(f"cannot add denominators with norm_len {self.norm_len} and "
                             f"{other.norm_len}", key="norm_len")
        return Denominators(self.tokens + other.tokens, self.seqs + other.seqs, self.norm_len)


AggFn = Callable[[torch.Tensor, torch.Tensor, Denominators], torch.Tensor]

#: Registry of aggregation modes ``fn(loss_mat, bool_mask, denom) -> scalar``.
AGG_MODES: Registry[AggFn] = Registry("loss aggregation mode")


def bool_mask(mask, shape=None) -> torch.Tensor:
    """``mask`` as a bool tensor (bool, or 0/1 numbers) of ``shape`` (``None``: any shape with at
    least one dimension); raises InputError naming ``mask`` for a wrong shape or values other
    than 0/1. Every algo function takes masks this way."""
    got = tuple(mask.shape) if isinstance(mask, torch.Tensor) else None
    if got is None or not got or (shape is not None and got != tuple(shape)):
        want = f"shape {tuple(shape)}" if shape is not None else "a tensor [B, R]"
        raise InputError(f"expected {want} (bool or 0/1), got "
                         f"{got if got is not None else type(mask).__name__}", key="mask")
    if mask.dtype == torch.bool:
        return mask
    if mask.numel() and not bool(((mask == 0) | (mask == 1)).all()):
        raise InputError("a non-bool mask must hold only 0 and 1", key="mask")
    return mask != 0


def _safe_div(num: torch.Tensor, den: float | torch.Tensor) -> torch.Tensor:
    """``num / den``, or ``num * 0`` when ``den == 0`` (num is then 0 too: keeps the graph)."""
    if isinstance(den, torch.Tensor):
        return num / torch.where(den == 0, torch.ones_like(den), den)
    return num / den if den != 0 else num * 0.0


def _row_sums(loss_mat: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``[B]``: sum over the last dim of the loss where the mask is True (NaN-safe)."""
    return torch.where(mask, loss_mat, torch.zeros_like(loss_mat)).sum(dim=-1)


@AGG_MODES.register("token-mean")
def _token_mean(loss_mat, mask, denom):
    return _safe_div(_row_sums(loss_mat, mask).sum(), denom.tokens)


@AGG_MODES.register("seq-mean-token-sum")
def _seq_mean_token_sum(loss_mat, mask, denom):
    return _safe_div(_row_sums(loss_mat, mask).sum(), denom.seqs)


@AGG_MODES.register("seq-mean-token-mean")
def _seq_mean_token_mean(loss_mat, mask, denom):
    n_i = mask.sum(dim=-1).to(loss_mat.dtype)               # [B], local: rows are never split
    per_row = _safe_div(_row_sums(loss_mat, mask), n_i)     # empty rows -> 0
    return _safe_div(per_row.sum(), denom.seqs)


@AGG_MODES.register("seq-mean-token-sum-norm")
def _seq_mean_token_sum_norm(loss_mat, mask, denom):
    return _safe_div(_row_sums(loss_mat, mask).sum(), denom.seqs * denom.norm_len)


def agg_loss(loss_mat: torch.Tensor, mask: torch.Tensor, mode: str,
             denom: Denominators | None = None) -> torch.Tensor:
    """Aggregate a per-token loss to a scalar according to ``mode`` (see the module table).

    Args:
        loss_mat: ``[B, R]`` per-token loss (float; may carry grad). Values where ``mask`` is
            False are ignored, even NaN/inf.
        mask: ``[B, R]`` bool or 0/1; True/1 = the token counts.
        mode: a name in :data:`AGG_MODES`.
        denom: global counts (``Denominators.of`` of the whole mini-batch, summed over ranks);
            the result is then this batch's contribution. ``None``: this batch's own counts.
    Returns:
        A 0-dim tensor in ``loss_mat``'s dtype; 0 (not NaN) when the denominator is 0.
    """
    fn = AGG_MODES.get(mode, key="mode")
    m = bool_mask(mask, loss_mat.shape)
    if denom is None:
        denom = Denominators.of(m)
    elif not isinstance(denom, Denominators):
        raise InputError(f"expected Denominators or None, got {type(denom).__name__}",
                         key="denom")
    elif (denom.tokens == 0 or denom.seqs == 0) and bool(m.any()):
        # A zero global count while this part has valid tokens: the counts are of another batch.
        raise InputError(f"{denom} counts no valid token, but this batch has "
                         f"{int(m.sum())}", key="denom")
    return fn(loss_mat, m, denom)


def masked_sum(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Sum of ``x`` over positions where ``mask`` (same shape; True/1 = counts) is set.

    NaN/inf under mask 0 are ignored. Returns a 0-dim tensor (0 when nothing is valid).
    """
    m = bool_mask(mask, x.shape)
    return torch.where(m, x, torch.zeros_like(x)).sum()


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Token-mean: ``sum(x * mask) / N_tok`` (denominator = number of valid positions).

    ``x`` and ``mask`` have the same shape. Returns a 0-dim tensor; 0 when no position is valid.
    """
    m = bool_mask(mask, x.shape)
    return _safe_div(torch.where(m, x, torch.zeros_like(x)).sum(), float(m.sum()))


def _masked_extreme(x, mask, empty, fill, reduce):
    m = bool_mask(mask, x.shape)
    if not bool(m.any()):
        return torch.full((), empty, dtype=x.dtype, device=x.device)
    return reduce(torch.where(m, x, torch.full_like(x, fill)))


def masked_max(x: torch.Tensor, mask: torch.Tensor, *, empty: float = 0.0) -> torch.Tensor:
    """Max of ``x`` over positions where ``mask`` (same shape, True/1 = counts) is set.

    NaN/inf under mask 0 are ignored; returns ``empty`` (a 0-dim tensor) when none is valid.
    """
    return _masked_extreme(x, mask, empty, float("-inf"), torch.amax)


def masked_min(x: torch.Tensor, mask: torch.Tensor, *, empty: float = 0.0) -> torch.Tensor:
    """Min of ``x`` over positions where ``mask`` is set; see :func:`masked_max`."""
    return _masked_extreme(x, mask, empty, float("inf"), torch.amin)
