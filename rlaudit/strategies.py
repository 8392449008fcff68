"""Hypothesis strategies for rollout batches, loss matrices and permutations.

Use them in property tests of loss, advantage and batching functions (rlaudit's own and, through
``targets/``, a user's trainer)::

    from hypothesis import given
    from rlaudit.strategies import rollout_batches

    @given(rollout_batches(max_groups=3, fields=("scores", "old_log_probs")))
    def test_my_loss_ignores_masked_values(batch):
        ...

The batches are built to hit the cases trainers get wrong: ragged prompt and response lengths,
singleton groups, empty responses (length 0), rows whose mask is all False, masked holes inside a
response, shuffled rows (a group's rows are not contiguous) with arbitrary int64 ``uid`` values,
extra padding columns, and large finite garbage (up to 1e30) in float fields wherever
``response_mask`` is False. Garbage is finite because :meth:`RolloutBatch.validate` rejects
NaN/inf; a function that multiplies by the mask instead of selecting with it still shows up
(``0 * 1e30`` is fine but ``exp(1e30) * 0`` is NaN). Token ids (also past a row's length) are in
``[0, vocab_size)``.

Structure (sizes, lengths, masks, uids, row order) is drawn by hypothesis and shrinks; float
values are drawn from a torch generator seeded by hypothesis (a per-element float draw would
exhaust hypothesis' data buffer on [16, 8] batches with several fields).
"""

from __future__ import annotations

import math
from typing import Sequence

import torch
from hypothesis import strategies as st
from hypothesis.strategies import SearchStrategy

from rlaudit.data.batch import KNOWN_FIELDS, REQUIRED_FIELDS, Kind, RolloutBatch
from rlaudit.errors import InputError

#: largest garbage magnitude under mask 0: big enough that exp() overflows, finite in fp32/bf16.
GARBAGE_MAX = 1e30
#: valid log-probs lie in [-LOG_PROB_SPAN, 0]: wide enough for rare tokens, small enough that
#: ratios exp(logp - old_logp) stay representable.
LOG_PROB_SPAN = 8.0
#: old/ref/teacher log-probs differ from the sampling log-probs by up to this much (ratios ~ 1).
LOG_PROB_JITTER = 0.5
#: range of scores, values, advantages, returns and rewards on valid entries.
VALUE_SPAN = 10.0
#: rollout importance weights on valid tokens lie in [0, MAX_IS_WEIGHT].
MAX_IS_WEIGHT = 3.0

_LOG_PROB_FIELDS = ("rollout_log_probs", "old_log_probs", "ref_log_probs", "teacher_log_probs",
                    "teacher_topk_log_probs")
_TOPK_FIELDS = ("teacher_topk_ids", "teacher_topk_log_probs")  # [B, R, K]
#: fields that come with sidecar meta (several reward functions: rlaudit/data/rewards.py), not
#: drawn here
_WITH_META = ("reward_scores", "reward_mask")
#: every optional field :func:`rollout_batches` can generate.
SUPPORTED_FIELDS = tuple(sorted(set(KNOWN_FIELDS) - set(REQUIRED_FIELDS) - set(_WITH_META)))
DEFAULT_FIELDS = ("scores", "rollout_log_probs", "old_log_probs", "ref_log_probs", "values",
                  "advantages", "token_level_rewards")
_INT64 = (-2**63, 2**63 - 1)


def _int_arg(name: str, value: object, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise InputError(f"expected an int >= {low}, got {value!r}", key=name)
    return value


def _order_args(low_name: str, low: int, high_name: str, high: int) -> None:
    if low > high:
        raise InputError(f"must be <= {high_name}={high}, got {low}", key=low_name)


def _float_dtype_arg(dtype: object) -> torch.dtype:
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise InputError(f"expected a floating torch.dtype, got {dtype!r}", key="dtype")
    return dtype


def _garbage_bound(dtype: torch.dtype) -> float:
    return min(GARBAGE_MAX, torch.finfo(dtype).max / 16)


def _garbage(shape: tuple[int, ...], g: torch.Generator, dtype: torch.dtype) -> torch.Tensor:
    """Finite values of every magnitude from 1 to the garbage bound, both signs."""
    exponent = torch.rand(shape, generator=g, dtype=torch.float64) * math.log10(
        _garbage_bound(dtype))
    sign = torch.where(torch.rand(shape, generator=g) < 0.5, -1.0, 1.0).to(torch.float64)
    return (sign * 10.0 ** exponent).to(dtype)


def _valid_values(name: str, shape: tuple[int, ...], g: torch.Generator,
                  base_log_probs: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """float64 values a real trainer would produce for field ``name`` (before masking): log-probs
    near the sampling log-probs and <= 0, entropy in [0, log V], importance weights in
    [0, MAX_IS_WEIGHT], anything else (scores, values, advantages, rewards, kl, ...) in
    [-VALUE_SPAN, VALUE_SPAN]."""
    u = torch.rand(shape, generator=g, dtype=torch.float64)
    if name == "rollout_log_probs":
        return base_log_probs.clone()
    if name in _TOPK_FIELDS:
        return -u * LOG_PROB_SPAN
    if name in _LOG_PROB_FIELDS:
        return (base_log_probs + (2 * u - 1) * LOG_PROB_JITTER).clamp(max=0.0)
    if name == "entropy":
        return u * math.log(vocab_size)
    if name == "rollout_is_weights":
        return u * MAX_IS_WEIGHT
    return (2 * u - 1) * VALUE_SPAN


def _fields_arg(fields: Sequence[str]) -> tuple[str, ...]:
    """``fields`` checked against :data:`SUPPORTED_FIELDS`, duplicates dropped, order kept."""
    if isinstance(fields, str):
        raise InputError("expected a sequence of field names, got a single string", key="fields")
    for name in fields:
        if name not in SUPPORTED_FIELDS:
            raise InputError(f"unsupported field {name!r}; valid: {', '.join(SUPPORTED_FIELDS)}",
                             key="fields")
    return tuple(dict.fromkeys(fields))


def _optional_field(draw, name: str, dims: tuple[int, int, int, int], g: torch.Generator,
                    base_log_probs: torch.Tensor, mask: torch.Tensor, vocab_size: int,
                    dtype: torch.dtype) -> torch.Tensor:
    """One optional field of a drawn batch. ``dims`` = (B, P, R, K); the field's shape follows
    its kind: [B] per sequence, [B, P] per prompt token, [B, R(, K)] per response token.
    base_log_probs [B, R]: the batch's shared log-probs (log-prob fields jitter around them).
    mask [B, R]: valid response tokens; a per-token field holds garbage where it is False."""
    b, p, r, topk = dims
    spec = KNOWN_FIELDS[name]
    kind = spec.kind
    shape = ((b,) if kind == Kind.SEQ else (b, p) if kind == Kind.PROMPT
             else (b, r, topk) if name in _TOPK_FIELDS else (b, r))
    if spec.dtype == "int":  # token ids (e.g. teacher_topk_ids)
        return torch.randint(0, vocab_size, shape, generator=g)
    if spec.dtype == "bool":
        return torch.rand(shape, generator=g) < 0.5
    if name == "scores" and draw(st.booleans()):  # binary rule scores: zero-std groups
        return (torch.rand(shape, generator=g) < 0.5).to(dtype)
    valid = _valid_values(name, shape, g, base_log_probs, vocab_size).to(dtype)
    if kind == Kind.TOKEN:
        keep = mask if len(shape) == 2 else mask.unsqueeze(-1).expand(shape)
        valid = torch.where(keep, valid, _garbage(shape, g, dtype))
    return valid


def rollout_batches(*, min_groups: int = 1, max_groups: int = 4, min_group_size: int = 1,
                    max_group_size: int = 4, max_prompt_len: int = 6, max_response_len: int = 8,
                    allow_empty_responses: bool = True, allow_masked_holes: bool = True,
                    dtype: torch.dtype = torch.float64, fields: Sequence[str] = DEFAULT_FIELDS,
                    vocab_size: int = 32, topk: int = 3) -> SearchStrategy[RolloutBatch]:
    """Valid :class:`RolloutBatch` es with the edge cases listed in the module docstring.

    Args (keyword-only, checked when called; a bad one raises InputError naming it):
        min_groups, max_groups: number of prompt groups (distinct ``uid``), ``1 <= min <= max``.
        min_group_size, max_group_size: rows per group, ``1 <= min <= max`` (1 = singleton).
        max_prompt_len: prompt lengths are in ``[1, max_prompt_len]``; rows of a group share
            their prompt. ``P`` is in ``[longest prompt, max_prompt_len]``.
        max_response_len: response lengths are in ``[0 or 1, max_response_len]``; ``R`` is in
            ``[max(1, longest response), max_response_len]``.
        allow_empty_responses: allow response length 0.
        allow_masked_holes: allow ``response_mask`` False inside a response, including rows of
            positive length whose mask is all False. If False, ``mask[i, t] == (t < len_i)``.
        dtype: floating dtype of every float field.
        fields: optional fields to add (see :data:`SUPPORTED_FIELDS`); the required fields are
            always there. Log-prob fields are ``<= 0`` on valid tokens, entropy ``>= 0``.
        vocab_size: token ids are in ``[0, vocab_size)``.
        topk: K of ``teacher_topk_ids`` / ``teacher_topk_log_probs`` (``[B, R, K]``).

    Example::

        >>> batch = rollout_batches(max_groups=2).example()  # doctest: +SKIP
        >>> batch["response_mask"].shape == (len(batch), batch.response_width)
        True
    """
    for name, value, low in (("min_groups", min_groups, 1), ("max_groups", max_groups, 1),
                             ("min_group_size", min_group_size, 1),
                             ("max_group_size", max_group_size, 1),
                             ("max_prompt_len", max_prompt_len, 1),
                             ("max_response_len", max_response_len, 1),
                             ("vocab_size", vocab_size, 1), ("topk", topk, 1)):
        _int_arg(name, value, low)
    _order_args("min_groups", min_groups, "max_groups", max_groups)
    _order_args("min_group_size", min_group_size, "max_group_size", max_group_size)
    dtype = _float_dtype_arg(dtype)
    fields = _fields_arg(fields)
    mask_modes = ["full", "holes", "all_masked"] if allow_masked_holes else ["full"]

    @st.composite
    def draw_batch(draw) -> RolloutBatch:
        sizes = draw(st.lists(st.integers(min_group_size, max_group_size),
                              min_size=min_groups, max_size=max_groups))
        uids = draw(st.lists(st.integers(*_INT64), min_size=len(sizes), max_size=len(sizes),
                             unique=True))
        prompt_lens = [draw(st.integers(1, max_prompt_len)) for _ in sizes]
        group_of_row = draw(st.permutations([g for g, n in enumerate(sizes) for _ in range(n)]))
        b = len(group_of_row)
        resp_lens = [draw(st.integers(0 if allow_empty_responses else 1, max_response_len))
                     for _ in range(b)]
        masks = []
        for n in resp_lens:
            mode = draw(st.sampled_from(mask_modes))
            if mode == "holes":
                masks.append(draw(st.lists(st.booleans(), min_size=n, max_size=n)))
            else:
                masks.append([mode == "full"] * n)
        p = draw(st.integers(max(prompt_lens), max_prompt_len))
        r = draw(st.integers(max(1, *resp_lens), max_response_len))
        g = torch.Generator().manual_seed(draw(st.integers(0, 2**63 - 1)))

        group_prompts = torch.randint(0, vocab_size, (len(sizes), p), generator=g)
        mask = torch.zeros(b, r, dtype=torch.bool)
        for i, m in enumerate(masks):
            mask[i, :len(m)] = torch.tensor(m, dtype=torch.bool)
        rows = torch.tensor(group_of_row, dtype=torch.int64)
        tensors = {
            "prompt_ids": group_prompts[rows].clone(),
            "prompt_lengths": torch.tensor(prompt_lens, dtype=torch.int64)[rows],
            "response_ids": torch.randint(0, vocab_size, (b, r), generator=g),
            "response_lengths": torch.tensor(resp_lens, dtype=torch.int64),
            "response_mask": mask,
            "uid": torch.tensor(uids, dtype=torch.int64)[rows],
        }
        base_log_probs = -torch.rand(b, r, generator=g, dtype=torch.float64) * LOG_PROB_SPAN
        for name in fields:
            tensors[name] = _optional_field(draw, name, (b, p, r, topk), g, base_log_probs, mask,
                                            vocab_size, dtype)
        return RolloutBatch.from_tensors(tensors, source="rlaudit.strategies.rollout_batches")

    return draw_batch()


def loss_matrices(*, min_rows: int = 1, max_rows: int = 6, min_width: int = 1,
                  max_width: int = 8, max_abs: float = 100.0, allow_empty_rows: bool = True,
                  dtype: torch.dtype = torch.float64
                  ) -> SearchStrategy[tuple[torch.Tensor, torch.Tensor]]:
    """``(loss_mat [B, R], mask [B, R] bool)`` pairs for loss-aggregation tests.

    ``B`` in ``[min_rows, max_rows]``, ``R`` in ``[min_width, max_width]``. Where the mask is True
    values are in ``[-max_abs, max_abs]``; where it is False they are finite garbage up to
    ``GARBAGE_MAX`` in magnitude. With ``allow_empty_rows`` rows (and whole matrices) may have no
    True entry; otherwise every row has at least one. Every element is a hypothesis draw (these
    are small), so failures shrink to small values.

    Example::

        >>> loss, mask = loss_matrices(max_rows=3).example()  # doctest: +SKIP
        >>> loss.shape == mask.shape
        True
    """
    for name, value, low in (("min_rows", min_rows, 1), ("max_rows", max_rows, 1),
                             ("min_width", min_width, 1), ("max_width", max_width, 1)):
        _int_arg(name, value, low)
    _order_args("min_rows", min_rows, "max_rows", max_rows)
    _order_args("min_width", min_width, "max_width", max_width)
    dtype = _float_dtype_arg(dtype)
    if isinstance(max_abs, bool) or not isinstance(max_abs, (int, float)) or not (
            0 < max_abs <= _garbage_bound(dtype)):
        raise InputError(f"expected a number in (0, {_garbage_bound(dtype):g}], got {max_abs!r}",
                         key="max_abs")
    valid = st.floats(-max_abs, max_abs, allow_nan=False, allow_infinity=False)
    garbage = st.floats(-_garbage_bound(dtype), _garbage_bound(dtype), allow_nan=False,
                        allow_infinity=False)

    @st.composite
    def draw_pair(draw) -> tuple[torch.Tensor, torch.Tensor]:
        b = draw(st.integers(min_rows, max_rows))
        r = draw(st.integers(min_width, max_width))
        mask_rows = []
        for _ in range(b):
            row = draw(st.lists(st.booleans(), min_size=r, max_size=r))
            if not allow_empty_rows and not any(row):
                row[draw(st.integers(0, r - 1))] = True
            mask_rows.append(row)
        values = [[draw(valid if m else garbage) for m in row] for row in mask_rows]
        return (torch.tensor(values, dtype=torch.float64).to(dtype),
                torch.tensor(mask_rows, dtype=torch.bool))

    return draw_pair()


def permutations(n: int) -> SearchStrategy[torch.Tensor]:
    """Permutations of ``range(n)`` as ``[n]`` int64 tensors (shrinking towards the identity).

    Example::

        >>> sorted(permutations(4).example().tolist())  # doctest: +SKIP
        [0, 1, 2, 3]
    """
    _int_arg("n", n, 0)
    return st.permutations(list(range(n))).map(lambda p: torch.tensor(p, dtype=torch.int64))
