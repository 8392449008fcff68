"""DAPO reward shaping and dynamic sampling (verl's DAPO recipe, docs/findings.md, seeds).

- :func:`overlong_penalty`: the soft length penalty added to a trajectory's score.
- :func:`filter_groups`: which rows survive "dynamic sampling" (drop prompt groups whose metric
  does not vary, since all their GRPO advantages would be 0).
"""

from __future__ import annotations

import torch

from rlaudit.errors import InputError

#: ``algorithm.filter_groups.metric`` values that read the rule score as sampled; the others
#: (``seq_reward``, ``seq_final_reward``) read it with the overlong penalty added
RAW_SCORE_METRICS = ("acc", "score")


def overlong_penalty(response_lengths: torch.Tensor, *, max_response_length: int, buffer_len: int,
                     penalty_factor: float, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The DAPO overlong penalty per trajectory.

    With ``expected = max_response_length - buffer_len`` and ``exceed = len - expected``:
    ``penalty = min(-exceed / buffer_len * penalty_factor, 0)``: 0 up to ``expected`` tokens,
    then linear down to ``-penalty_factor`` at ``max_response_length``.

    Args:
        response_lengths: [B] int, valid response tokens per row.
        max_response_length: the generation limit (``data.max_response_length``).
        buffer_len: > 0 and <= max_response_length (``reward.overlong_buffer.len``).
        penalty_factor: >= 0 (``reward.overlong_buffer.penalty_factor``).
        dtype: floating dtype of the result.

    Returns: [B] ``dtype``, <= 0; added to the score before
    :func:`rlaudit.algo.reward.place_scores`.
    """
    lens = response_lengths
    if (not isinstance(lens, torch.Tensor) or lens.dim() != 1 or lens.is_floating_point()
            or lens.dtype == torch.bool):
        raise InputError(f"expected an integer tensor [B], got "
                         f"{getattr(lens, 'dtype', type(lens).__name__)} "
                         f"{tuple(getattr(lens, 'shape', ()))}", key="response_lengths")
    if int(buffer_len) <= 0:
        raise InputError(f"expected > 0, got {buffer_len}", key="reward.overlong_buffer.len")
    if int(max_response_length) < int(buffer_len):
        raise InputError(f"max_response_length ({max_response_length}) must be >= the overlong "
                         f"buffer length ({buffer_len})", key="reward.overlong_buffer.len")
    if float(penalty_factor) < 0:
        raise InputError(f"expected >= 0, got {penalty_factor}",
                         key="reward.overlong_buffer.penalty_factor")
    if not dtype.is_floating_point:
        raise InputError(f"expected a floating dtype, got {dtype}", key="dtype")
    expected = int(max_response_length) - int(buffer_len)
    exceed = (lens - expected).to(dtype)
    return torch.clamp(-exceed / int(buffer_len) * float(penalty_factor), max=0.0)


def filter_groups(uid: torch.Tensor, metric: torch.Tensor) -> torch.Tensor:
    """DAPO dynamic sampling: which rows to keep.

    Args:
        uid: [B] int, group id (rows of one prompt; need not be contiguous).
        metric: [B] float, the per-trajectory metric (``algorithm.filter_groups.metric``:
            seq_reward, seq_final_reward, acc, ...). Must be finite.

    Returns:
        ``keep`` [B] bool: True for every row of a group whose metric has std > 0, and for the
        row of a single-row group. "std > 0" is decided exactly as "not all values equal"
        (group max > group min): a float std of identical values can come out as a tiny
        positive number from rounding and would wrongly keep the group.
    """
    if (not isinstance(uid, torch.Tensor) or uid.dim() != 1 or uid.is_floating_point()
            or uid.dtype == torch.bool):
        raise InputError(f"expected an integer tensor [B], got "
                         f"{getattr(uid, 'dtype', type(uid).__name__)} "
                         f"{tuple(getattr(uid, 'shape', ()))}", key="uid")
    if (not isinstance(metric, torch.Tensor) or tuple(metric.shape) != tuple(uid.shape)):
        raise InputError(f"expected shape {tuple(uid.shape)} (as uid), got "
                         f"{tuple(getattr(metric, 'shape', ()))}", key="metric")
    metric = metric.to(torch.float64) if not metric.is_floating_point() else metric
    if metric.numel() and not bool(torch.isfinite(metric).all()):
        raise InputError("metric must be finite (NaN/inf would make its group's std undefined)",
                         key="metric")
    if uid.numel() == 0:
        return torch.zeros(0, dtype=torch.bool, device=uid.device)
    _, inv, counts = torch.unique(uid, return_inverse=True, return_counts=True)
    g = counts.shape[0]
    gmax = metric.new_full((g,), -torch.inf).scatter_reduce(0, inv, metric, "amax")
    gmin = metric.new_full((g,), torch.inf).scatter_reduce(0, inv, metric, "amin")
    keep_group = (gmax > gmin) | (counts == 1)
    return keep_group[inv]


def num_kept_groups(uid: torch.Tensor, keep: torch.Tensor) -> int:
    """``train/num_kept_groups``: number of distinct ``uid`` values among kept rows."""
    return int(torch.unique(uid[keep]).numel())
