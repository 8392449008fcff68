"""Metric reduction for update steps.

Loss terms arrive as per-micro-batch *contributions* (numerator / global denominator). They are
summed over micro-batches, then summed over data-parallel ranks (one all-reduce of a packed vector
in sorted-name order, so every rank reduces the same keys), giving the mini-batch value. A
training step's value is the mean over its optimizer steps (equal weight per optimizer step).
"""

from __future__ import annotations

from collections import defaultdict

import torch


class MetricAccumulator:
    def __init__(self):
        self._steps: list[dict[str, float]] = []

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
        return {k: sums[k] / counts[k] for k in sums}
