"""Conversions between the three layouts of ragged per-row data: padded, packed and nested.

- **padded** ``x [B, W, ...]``: row i's items are ``x[i, :lengths[i]]``; the rest is padding.
- **packed** ``(values [N, ...], offsets [B+1] int64)`` with ``N = sum(lengths)``: row i's items
  are ``values[offsets[i]:offsets[i+1]]``, rows back to back in row order. ``offsets[0] = 0``.
- **nested**: a ``torch.nested`` tensor with the jagged layout (``layout=torch.jagged``), ragged
  along dim 1. It is exactly ``(values, offsets)`` wrapped in one object.

On torch 2.13 many ops on jagged nested tensors do not work or have no backward (``gather``,
``logsumexp``, the backward of ``log_softmax`` and of a ragged ``sum``).
rlaudit therefore treats nested tensors as an *input format* only: convert them with
:func:`nested_to_packed` / :func:`nested_to_padded` and compute on packed values + offsets or on
the padded tensor with a mask. Every conversion here is built from differentiable ops
(boolean indexing, ``index_put``, ``clone``), so gradients flow through it, and every output is a
new tensor (no output aliases an input). Trailing dims (e.g. top-k ``[B, R, K]``) are carried
along unchanged. Rows of length 0 are allowed everywhere.
"""

from __future__ import annotations

import torch

from rlaudit.errors import InputError


def _lengths_arg(lengths: torch.Tensor, batch: int, width: int, fn: str) -> torch.Tensor:
    """Check ``lengths`` ([B] integers in [0, width]) and return it as int64 on its device."""
    if not isinstance(lengths, torch.Tensor) or lengths.dim() != 1:
        raise InputError(f"{fn}: expected a 1-D tensor of row lengths", key="lengths")
    if lengths.is_floating_point() or lengths.is_complex() or lengths.dtype == torch.bool:
        raise InputError(f"{fn}: expected an integer tensor, got {lengths.dtype}", key="lengths")
    if lengths.shape[0] != batch:
        raise InputError(f"{fn}: expected {batch} lengths (one per row of x), got "
                         f"{lengths.shape[0]}", key="lengths")
    lengths = lengths.to(torch.int64)
    if batch and (int(lengths.min()) < 0 or int(lengths.max()) > width):
        raise InputError(f"{fn}: lengths must be in [0, {width}] (the padded width), got "
                         f"[{int(lengths.min())}, {int(lengths.max())}]", key="lengths")
    return lengths


def _offsets_arg(offsets: torch.Tensor, total: int, fn: str) -> torch.Tensor:
    """Check ``offsets`` ([B+1] non-decreasing integers from 0 to ``total``)."""
    if not isinstance(offsets, torch.Tensor) or offsets.dim() != 1 or offsets.shape[0] < 1:
        raise InputError(f"{fn}: expected a 1-D tensor of B+1 offsets", key="offsets")
    if offsets.is_floating_point() or offsets.is_complex() or offsets.dtype == torch.bool:
        raise InputError(f"{fn}: expected an integer tensor, got {offsets.dtype}", key="offsets")
    offsets = offsets.to(torch.int64)
    if int(offsets[0]) != 0 or int(offsets[-1]) != total:
        raise InputError(f"{fn}: offsets must start at 0 and end at the number of packed items "
                         f"{total}, got {int(offsets[0])} .. {int(offsets[-1])}", key="offsets")
    if bool((offsets[1:] < offsets[:-1]).any()):
        raise InputError(f"{fn}: offsets must be non-decreasing", key="offsets")
    return offsets


def lengths_to_offsets(lengths: torch.Tensor) -> torch.Tensor:
    """``[B]`` lengths -> ``[B+1]`` int64 offsets ``[0, l0, l0+l1, ...]`` (a new tensor)."""
    lengths = torch.as_tensor(lengths, dtype=torch.int64)
    return torch.cat([lengths.new_zeros(1), torch.cumsum(lengths, 0)])


def pad_to_packed(x: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Padded -> packed.

    Args:
        x: ``[B, W, ...]`` padded tensor; entries at ``t >= lengths[i]`` are ignored.
        lengths: ``[B]`` integers in ``[0, W]``.

    Returns:
        ``values [sum(lengths), ...]`` (rows back to back, in row order; a new tensor, gradients
        flow to ``x``) and ``offsets [B+1]`` int64.
    """
    if not isinstance(x, torch.Tensor) or x.dim() < 2:
        raise InputError("pad_to_packed: expected x with shape [B, W, ...]", key="x")
    lengths = _lengths_arg(lengths, x.shape[0], x.shape[1], "pad_to_packed").to(x.device)
    keep = torch.arange(x.shape[1], device=x.device).unsqueeze(0) < lengths.unsqueeze(1)
    return x[keep], lengths_to_offsets(lengths)


def packed_to_padded(values: torch.Tensor, offsets: torch.Tensor, width: int | None = None,
                     pad_value: float | int | bool = 0) -> torch.Tensor:
    """Packed -> padded.

    Args:
        values: ``[N, ...]`` packed items, ``N = offsets[-1]``.
        offsets: ``[B+1]`` non-decreasing, ``offsets[0] = 0``.
        width: padded width W, at least the longest row; ``None`` = the longest row.
        pad_value: written at ``t >= lengths[i]``.

    Returns:
        ``[B, W, ...]`` with ``values``' dtype (a new tensor; gradients flow to ``values``).
    """
    if not isinstance(values, torch.Tensor) or values.dim() < 1:
        raise InputError("packed_to_padded: expected values with shape [N, ...]", key="values")
    offsets = _offsets_arg(offsets, values.shape[0], "packed_to_padded").to(values.device)
    lengths = offsets[1:] - offsets[:-1]
    longest = int(lengths.max()) if lengths.numel() else 0
    if width is None:
        width = longest
    if isinstance(width, bool) or not isinstance(width, int) or width < longest:
        raise InputError(f"packed_to_padded: width must be an int >= the longest row "
                         f"({longest}), got {width!r}", key="width")
    batch = lengths.shape[0]
    out = torch.full((batch, width, *values.shape[1:]), pad_value, dtype=values.dtype,
                     device=values.device)
    rows = torch.repeat_interleave(torch.arange(batch, device=values.device), lengths)
    cols = torch.arange(values.shape[0], device=values.device) - offsets[:-1][rows]
    return out.index_put((rows, cols), values)


def padded_to_nested(x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Padded ``[B, W, ...]`` -> jagged nested tensor ``[B, j, ...]`` holding row i's first
    ``lengths[i]`` items. Its values are a new tensor (gradients flow to ``x``)."""
    values, offsets = pad_to_packed(x, lengths)
    return torch.nested.nested_tensor_from_jagged(values, offsets=offsets)


def nested_to_packed(nt: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Jagged nested tensor ``[B, j, ...]`` -> ``(values [N, ...], offsets [B+1] int64)``.

    Both are copies (never views of ``nt``'s buffers); gradients flow to ``nt``'s values.
    Nested tensors with holes (built with explicit ``lengths``) are rejected.
    """
    _check_jagged(nt, "nested_to_packed")
    return nt.values().clone(), nt.offsets().to(torch.int64).clone()


def nested_to_padded(nt: torch.Tensor, width: int | None = None,
                     pad_value: float | int | bool = 0) -> torch.Tensor:
    """Jagged nested tensor ``[B, j, ...]`` -> padded ``[B, W, ...]`` (``W`` = ``width`` or the
    longest row), ``pad_value`` at ``t >= length``. Computed on values + offsets, not with nested
    ops; gradients flow to ``nt``'s values."""
    _check_jagged(nt, "nested_to_padded")
    return packed_to_padded(nt.values(), nt.offsets(), width, pad_value)


def _check_jagged(nt: torch.Tensor, fn: str) -> None:
    if not isinstance(nt, torch.Tensor) or not nt.is_nested or nt.layout != torch.jagged:
        raise InputError(f"{fn}: expected a nested tensor with layout=torch.jagged "
                         "(build one with padded_to_nested)", key="nt")
    if getattr(nt, "_ragged_idx", 1) != 1:
        raise InputError(f"{fn}: expected the ragged dim to be dim 1, got dim "
                         f"{nt._ragged_idx}", key="nt")
    if nt.lengths() is not None:
        raise InputError(f"{fn}: nested tensors with holes (explicit lengths) are not supported",
                         key="nt")
