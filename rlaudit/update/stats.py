"""Metric reduction for update steps.

Loss terms arrive as per-micro-batch *contributions* (numerator / global denominator). They are
summed over micro-batches, then summed over data-parallel ranks (one all-reduce of a packed vector
in sorted-name order, so every rank reduces the same keys), giving the mini-batch value. A
training step's value is the mean over its optimizer steps (equal weight per optimizer step).

With ``trainer.metric_reduction = "microbatch-mean"`` (a target's declared convention, see
rlaudit/targets/contract/declare.py) loss-term stats arrive as each micro-batch's *local* value instead;
they are averaged over every real micro-batch of every rank and every optimizer step of the
training step (denominator: the number of real micro-batches), as verl's
``AggregationType.MEAN`` and TRL log them.
"""

from __future__ import annotations

from collections import defaultdict

import torch


#: suffix of a loss function's stat computed over the micro-batch's own counts (its local value,
#: reported next to the contribution when some metric is reduced as a micro-batch mean)
LOCAL = "@local"


def split_stats(micro_stats: list[dict], mode) -> tuple[list[dict], list[dict]]:
    """Per micro-batch: (contributions of the metrics ``mode(name)`` reduces as
    "contribution", local values of those it reduces as "microbatch-mean")."""
    contrib, local = [], []
    for s in micro_stats:
        contrib.append({k: v for k, v in s.items()
                        if not k.endswith(LOCAL) and mode(k) == "contribution"})
        local.append({k[:-len(LOCAL)]: v for k, v in s.items()
                      if k.endswith(LOCAL) and mode(k[:-len(LOCAL)]) == "microbatch-mean"})
    return contrib, local


class MetricAccumulator:
    def __init__(self):
        self._steps: list[dict[str, float]] = []
        self._micro_sums: dict[str, float] = defaultdict(float)
        self._micro_count = 0.0

    def add_micro_means(self, ctx, micro_stats: list[dict[str, torch.Tensor]], *,
                        real: int) -> None:
        """Accumulate the local values of the first ``real`` micro-batches (the rest are padding)
        of every rank: sums per name and the number of micro-batches, all-reduced over ranks."""
        names = sorted({k for s in micro_stats for k in s})   # same on every rank: padding
        local = torch.zeros(len(names) + 1, dtype=torch.float64)  # micro-batches report them too
        for s in micro_stats[:real]:
            for i, name in enumerate(names):
                if name in s:
                    local[i] += s[name].detach().double().cpu()
        local[-1] = real
        total = ctx.all_reduce(local, op="sum").cpu()
        for i, name in enumerate(names):
            self._micro_sums[name] += float(total[i])
        self._micro_count += float(total[-1])

    @staticmethod
    def sum_micro_stats(ctx, micro_stats: list[dict[str, torch.Tensor]]) -> dict[str, float]:
        """Sum contributions over micro-batches, then over ranks."""
        names = sorted({k for s in micro_stats for k in s})
        if not names:
            return {}
        local = torch.zeros(len(names), dtype=torch.float64)
        for s in micro_stats:
            for i, name in enumerate(names):
                if name in s:
                    local[i] += s[name].detach().double().cpu()
        total = ctx.all_reduce(local, op="sum").cpu()
        return {name: float(total[i]) for i, name in enumerate(names)}

    def add_step(self, stats: dict[str, float]) -> None:
        self._steps.append(dict(stats))

    def mean(self) -> dict[str, float]:
        sums: dict[str, float] = defaultdict(float)
        counts: dict[str, int] = defaultdict(int)
        for s in self._steps:
            for k, v in s.items():
                sums[k] += v
                counts[k] += 1
        out = {k: sums[k] / counts[k] for k in sums}
        if self._micro_count:
            out.update({k: v / self._micro_count for k, v in self._micro_sums.items()})
        return out
