"""Cutting a rollout batch into mini-batches, data-parallel shards and micro-batches.

Two layers:

- **planners** (``plan_*``) work on a row count or on per-row token counts and return a *plan*: a
  list of ``[n_k]`` int64 tensors of row indices, one per piece. Every row of the batch appears in
  exactly one piece (tests check this). Plans are deterministic.
- **cutters** (:func:`split_minibatches`, :func:`shard_for_dp`, :func:`microbatches_by_count`,
  :func:`microbatches_by_tokens`) apply a plan with :meth:`RolloutBatch.select` (:func:`take`).
  Use the planner when you also need the row indices, e.g. to scatter per-token outputs back into
  batch order.

Every piece keeps the batch's full widths P and R (no trimming): per-token outputs of all
micro-batches then have the same ``[n_k, R]`` shape and concatenate without re-padding. A caller
that wants less padded compute may call :meth:`RolloutBatch.trim` on a micro-batch *for the model
forward only* and pad the per-token results back to R (``rlaudit.data.batch.pad_dim1``).

Token counts are ``prompt_lengths + response_lengths`` (:meth:`RolloutBatch.sequence_lengths`):
what the model processes for that row, as in verl's ``ppo_max_token_len_per_gpu``.

Padding micro-batches (SkyRL PR #1811): so that every data-parallel rank runs the same number of
forward/backward passes, short ranks append :func:`padding_microbatch` es. They are built from the
template batch's own fields (never a hard-coded key list), so every field, known or extra, is
present with the template's dtype and trailing shape, and ``response_mask`` is all False.

Nothing here mutates its input; every returned batch holds new tensors (``index_select``).
"""

from __future__ import annotations

from typing import Literal, Sequence

import torch

from rlaudit.data.batch import RolloutBatch
from rlaudit.errors import InputError

#: uid of a padding row; it joins no real group (advantages are computed before batching anyway).
PADDING_UID = -1
#: meta key set to True on padding micro-batches (e.g. to reset MoE router-replay state on them).
PADDING_META_KEY = "padding_microbatch"

Plan = list[torch.Tensor]


def _positive_int(value: object, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InputError(f"expected a positive int, got {value!r}", key=name)
    return value


def _token_counts(lengths: torch.Tensor | Sequence[int]) -> torch.Tensor:
    lengths = torch.as_tensor(lengths)
    if lengths.dim() != 1 or lengths.is_floating_point() or lengths.dtype == torch.bool:
        raise InputError(f"expected a 1-D integer tensor of per-row token counts, got "
                         f"{lengths.dtype} of shape {tuple(lengths.shape)}", key="lengths")
    return lengths.to(torch.int64).cpu()


# ---- planners -------------------------------------------------------------------------------
def plan_minibatches(batch_size: int, size: int, *, shuffle: bool = False, seed: int = 0) -> Plan:
    """Rows ``0..batch_size-1`` in ``batch_size // size`` consecutive pieces of ``size`` rows.

    With ``shuffle`` the rows are first permuted by ``torch.randperm`` on a CPU generator seeded
    with ``seed`` (the same seed gives the same plan on every machine). ``size`` must divide
    ``batch_size`` (as in verl: every optimizer step sees the same number of rows).
    """
    size = _positive_int(size, "size")
    if batch_size % size:
        raise InputError(f"mini-batch size {size} does not divide the batch size {batch_size}",
                         key="size")
    order = (torch.randperm(batch_size, generator=torch.Generator().manual_seed(seed))
             if shuffle else torch.arange(batch_size))
    return [order[i:i + size].clone() for i in range(0, batch_size, size)]


def plan_dp_shards(lengths: torch.Tensor | Sequence[int], dp_size: int, *,
                   balance: bool = False) -> Plan:
    """Split ``B = len(lengths)`` rows into ``dp_size`` shards of ``B // dp_size`` rows each.

    ``balance=False``: contiguous shards (rank k gets rows ``k*n .. (k+1)*n - 1``).

    ``balance=True``: equal-count shards with balanced token sums ("sorted rounds"): rows are
    sorted by token count, descending (ties: lower index first), and dealt in rounds of
    ``dp_size``; in each round the largest remaining row goes to the currently lightest shard,
    the next to the next lightest, and so on (shard ties: lower rank first). Every shard gains
    one row per round, so counts are equal, and the spread ``max(shard sum) - min(shard sum)``
    never exceeds ``max(lengths) - min(lengths)`` (an induction over rounds: a heavier shard
    always receives a smaller row). Within a shard rows are in ascending index order.
    """
    dp_size = _positive_int(dp_size, "dp_size")
    lengths = _token_counts(lengths)
    b = lengths.shape[0]
    if b % dp_size:
        raise InputError(f"batch size {b} is not divisible by dp_size {dp_size}",
                         key="dp_size")
    n = b // dp_size
    if not balance:
        return [torch.arange(k * n, (k + 1) * n) for k in range(dp_size)]
    order = sorted(range(b), key=lambda i: (-int(lengths[i]), i))
    loads = [0] * dp_size
    shards: list[list[int]] = [[] for _ in range(dp_size)]
    for start in range(0, b, dp_size):
        lightest_first = sorted(range(dp_size), key=lambda k: (loads[k], k))
        for rank, row in zip(lightest_first, order[start:start + dp_size]):
            shards[rank].append(row)
            loads[rank] += int(lengths[row])
    return [torch.tensor(sorted(s), dtype=torch.int64) for s in shards]


def plan_microbatches_by_count(batch_size: int, size: int) -> Plan:
    """Consecutive pieces of ``size`` rows; the last one has ``batch_size % size`` rows if that
    is not 0. (Correct losses need global denominators anyway, see docs/internals.md.)"""
    size = _positive_int(size, "size")
    return [torch.arange(i, min(i + size, batch_size)) for i in range(0, batch_size, size)]


def plan_microbatches_by_tokens(
        lengths: torch.Tensor | Sequence[int], max_tokens: int, *,
        method: Literal["in_order", "first_fit_decreasing"] = "in_order") -> Plan:
    """Pieces whose token sum is at most ``max_tokens``.

    ``in_order`` (default): rows in batch order; a piece is closed when the next row would
    exceed the budget (pieces are contiguous ranges; order preserved).
    ``first_fit_decreasing``: rows sorted by token count, descending (ties: lower index first),
    each put into the first open piece it fits in, else a new piece; fewer pieces in general.
    Rows inside a piece are in ascending index order; pieces are in the order they were opened.

    A row with more tokens than ``max_tokens`` is an :class:`InputError` naming the row.
    """
    max_tokens = _positive_int(max_tokens, "max_tokens")
    lengths = _token_counts(lengths)
    if lengths.numel() and int(lengths.max()) > max_tokens:
        row = int(torch.argmax((lengths > max_tokens).to(torch.int8)))
        raise InputError(f"row {row} has {int(lengths[row])} tokens (prompt + response), more "
                         f"than the micro-batch token budget max_tokens={max_tokens}",
                         key="max_tokens")
    if method == "in_order":
        order = list(range(lengths.shape[0]))
    elif method == "first_fit_decreasing":
        order = sorted(range(lengths.shape[0]), key=lambda i: (-int(lengths[i]), i))
    else:
        raise InputError(f"unknown method {method!r}; valid: first_fit_decreasing, in_order",
                         key="method")
    pieces: list[list[int]] = []
    sums: list[int] = []
    for row in order:
        n = int(lengths[row])
        if method == "in_order":
            target = len(pieces) - 1 if pieces and sums[-1] + n <= max_tokens else None
        else:
            target = next((k for k, s in enumerate(sums) if s + n <= max_tokens), None)
        if target is None:
            pieces.append([])
            sums.append(0)
            target = len(pieces) - 1
        pieces[target].append(row)
        sums[target] += n
    return [torch.tensor(sorted(p), dtype=torch.int64) for p in pieces]


# ---- cutters --------------------------------------------------------------------------------
def take(batch: RolloutBatch, plan: Plan) -> list[RolloutBatch]:
    """``[batch.select(rows) for rows in plan]``: new batches, widths P and R kept."""
    return [batch.select(rows) for rows in plan]


def split_minibatches(batch: RolloutBatch, size: int, *, shuffle: bool = False,
                      seed: int = 0) -> list[RolloutBatch]:
    """Mini-batches of ``size`` rows (one optimizer step each); see :func:`plan_minibatches`."""
    return take(batch, plan_minibatches(len(batch), size, shuffle=shuffle, seed=seed))


def shard_for_dp(batch: RolloutBatch, dp_size: int, *, balance: bool = False
                 ) -> list[RolloutBatch]:
    """One equal-count shard per data-parallel rank; see :func:`plan_dp_shards`. Balancing uses
    :meth:`RolloutBatch.sequence_lengths` as the token count."""
    return take(batch, plan_dp_shards(batch.sequence_lengths(), dp_size, balance=balance))


def microbatches_by_count(batch: RolloutBatch, size: int) -> list[RolloutBatch]:
    """Micro-batches of ``size`` rows in order (the last may be smaller)."""
    return take(batch, plan_microbatches_by_count(len(batch), size))


def microbatches_by_tokens(
        batch: RolloutBatch, max_tokens: int, *,
        method: Literal["in_order", "first_fit_decreasing"] = "in_order") -> list[RolloutBatch]:
    """Micro-batches under a token budget over ``sequence_lengths()``; see
    :func:`plan_microbatches_by_tokens`."""
    return take(batch, plan_microbatches_by_tokens(batch.sequence_lengths(), max_tokens,
                                                   method=method))


# ---- padding micro-batches ------------------------------------------------------------------
def padding_microbatch(template: RolloutBatch) -> RolloutBatch:
    """A one-row batch with every field of ``template`` that contributes nothing to any loss.

    Every field (known or extra, any kind) is present with the template's dtype, device and
    trailing shape ``[1, *t.shape[1:]]`` (so P and R are the template's). All values are zero /
    False except: ``prompt_lengths = 1`` (a valid one-token prompt, so a model forward runs),
    ``response_lengths = 0``, ``response_mask`` all False, ``uid = PADDING_UID``. Its meta is the
    template's with ``PADDING_META_KEY: True``. Any masked reduction over it sums nothing, and with
    global denominators (docs/internals.md) it adds neither tokens nor sequences.
    """
    fixed = {"prompt_lengths": 1, "response_lengths": 0, "uid": PADDING_UID}
    tensors = {}
    for name, t in template.tensors.items():
        tensors[name] = torch.full((1, *t.shape[1:]), fixed.get(name, 0), dtype=t.dtype,
                                   device=t.device)
    meta = {**template.meta, PADDING_META_KEY: True}
    out = RolloutBatch(tensors, dict(template.kinds), meta)
    out.validate(source="padding_microbatch")
    return out


def is_padding_microbatch(batch: RolloutBatch) -> bool:
    """True for batches made by :func:`padding_microbatch`."""
    return bool(batch.meta.get(PADDING_META_KEY, False))


def pad_microbatch_list(micros: Sequence[RolloutBatch], target_count: int,
                        template: RolloutBatch) -> list[RolloutBatch]:
    """``micros`` followed by ``target_count - len(micros)`` padding micro-batches built from
    ``template`` (a new list; the batches in ``micros`` are not copied or changed).

    Every micro-batch must have the template's fields, kinds and widths (a mismatch is exactly the
    bug padding micro-batches used to cause); more than ``target_count`` micro-batches is an error.
    """
    if isinstance(target_count, bool) or not isinstance(target_count, int) or target_count < 0:
        raise InputError(f"expected a non-negative int, got {target_count!r}", key="target_count")
    if len(micros) > target_count:
        raise InputError(f"{len(micros)} micro-batches already exceed target_count "
                         f"{target_count}", key="target_count")
    want = {k: (template.kinds[k], t.dtype, tuple(t.shape[1:]))
            for k, t in template.tensors.items()}
    for i, mb in enumerate(micros):
        have = {k: (mb.kinds[k], t.dtype, tuple(t.shape[1:])) for k, t in mb.tensors.items()}
        if have != want:
            diff = sorted(k for k in set(want) | set(have) if want.get(k) != have.get(k))
            raise InputError(f"micro-batch {i} differs from the template in fields "
                             f"{diff} (presence, kind, dtype or trailing shape)", key="micros")
    return list(micros) + [padding_microbatch(template) for _ in range(target_count - len(micros))]
