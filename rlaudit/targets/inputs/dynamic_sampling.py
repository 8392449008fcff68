"""Unfiltered inputs for a target whose ``train_step`` applies DAPO's group filter itself
(``filters_groups = True`` on the adapter).

The scenario engine filters a scenario's rollout once (:func:`rlaudit.update.step.select_groups`)
and builds every variant from the kept rows; the reference backend trains on those. A target that
filters inside its own ``train_step`` must instead receive the rows it is expected to drop, so that
its filter (code under audit: a field re-taken from the unfiltered batch after filtering misaligns
rows) actually runs. For each variant with ``algorithm.filter_groups.enable``, this module puts the
dropped groups back: their rows (from the unfiltered rollout, fitted to the variant's fields and
widths) are interleaved with the variant's rows at fixed positions, the first at position 0. A
correct filter keeps exactly the variant's rows, in their order (as verl's recipe does:
``new_batch[kept_traj_idxs]`` keeps the order), so the target's outputs line up with the
reference's and every invariant compares them as usual.

A variant on which the filter would not give back exactly its own rows (a re-cut batch in which a
kept group lost its spread, a changed filter metric, a uid shared with a dropped group) is not run
on the target; the reason is recorded and its invariants are n/a for the target.
"""

from __future__ import annotations

import torch

from rlaudit.algo.dapo import filter_groups
from rlaudit.backends.base import Variant
from rlaudit.data.batch import Kind, RolloutBatch, pad_dim1
from rlaudit.update.step import filter_metric


def unfiltered_inputs(variants: list[Variant], raw: RolloutBatch
                      ) -> tuple[dict[str, RolloutBatch], dict[str, str]]:
    """``(inputs, skipped)``: per variant name with the group filter enabled, the batch to hand a
    self-filtering target (the variant's rows with the dropped groups of ``raw`` interleaved), or
    the reason it cannot be given one."""
    inputs, skipped = {}, {}
    for v in variants:
        if not v.config.algorithm.filter_groups.enable:
            continue
        keep = filter_groups(raw["uid"], filter_metric(raw, v.config))
        dropped = raw.select((~keep).nonzero().flatten())
        fitted, why = _fit(dropped, v.batch)
        if fitted is None:
            skipped[v.name] = f"the dropped groups cannot be put back into this variant: {why}"
            continue
        combined, kept_at = interleave(v.batch, fitted)
        got = filter_groups(combined["uid"], filter_metric(combined, v.config))
        want = torch.zeros(len(combined), dtype=torch.bool)
        want[kept_at] = True
        if not torch.equal(got, want):
            skipped[v.name] = ("DAPO's group filter would not keep exactly this variant's rows "
                               "(a kept group has no spread in it, or a dropped group's uid "
                               "is reused)")
            continue
        inputs[v.name] = combined
    return inputs, skipped


def interleave(kept: RolloutBatch, dropped: RolloutBatch) -> tuple[RolloutBatch, torch.Tensor]:
    """Rows of ``kept`` in order with the ``m`` rows of ``dropped`` at positions
    ``k * (n + m) // m`` (the first at 0, spread over the batch). Returns the batch and the
    positions of the kept rows."""
    n, m = len(kept), len(dropped)
    total = n + m
    if m == 0:
        return kept, torch.arange(n)
    drop_at = torch.tensor([k * total // m for k in range(m)])
    is_drop = torch.zeros(total, dtype=torch.bool)
    is_drop[drop_at] = True
    kept_at = (~is_drop).nonzero().flatten()
    both = RolloutBatch.concat([kept, dropped])
    order = torch.empty(total, dtype=torch.long)
    order[kept_at] = torch.arange(n)
    order[drop_at] = n + torch.arange(m)
    return both.select(order), kept_at


def _fit(rows: RolloutBatch, like: RolloutBatch) -> tuple[RolloutBatch | None, str]:
    """``rows`` with exactly ``like``'s fields, dtypes and widths P and R (padded, or narrowed
    when nothing valid is cut), or (None, why)."""
    if not len(rows):
        return rows, ""
    missing = sorted(set(like.keys()) - set(rows.keys()))
    if missing:
        return None, f"the variant has fields the rollout lacks: {missing}"
    if int(rows["prompt_lengths"].max()) > like.prompt_width or (
            int(rows["response_lengths"].max()) > like.response_width):
        return None, "the variant is narrower than the dropped rows"
    out = {}
    for name, t in like.tensors.items():
        x = rows[name].to(t.dtype)
        if like.kinds[name] in (Kind.PROMPT, Kind.TOKEN):
            width = t.shape[1]
            x = x[:, :width] if x.shape[1] >= width else pad_dim1(x, width)
        out[name] = x
    return RolloutBatch(out, dict(like.kinds), dict(like.meta)), ""
