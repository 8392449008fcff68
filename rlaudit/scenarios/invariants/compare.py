"""Comparing two runs (metrics per step, per-token tensors, updated parameters) within a
scenario's tolerances: the workhorse of the metamorphic and parity invariants."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from rlaudit.backends.base import VariantRun
from rlaudit.metrics import golden_names
from rlaudit.scenarios.invariants.base import compare_tensors
from rlaudit.scenarios.spec import Scenario

#: per-token tensors compared between runs (when both have them)
COMPARED_TOKENS = ("probe_log_probs", "probe_entropy", "old_log_probs", "ref_log_probs", "values",
                   "advantages", "returns", "kl", "token_level_rewards", "rollout_is_weights")


@dataclass
class Comparison:
    ok: bool = True
    failures: list[str] = field(default_factory=list)
    details: dict = field(default_factory=dict)
    drift: float = 0.0

    def fail(self, msg: str, **details) -> None:
        self.ok = False
        self.failures.append(msg)
        if details:
            self.details.setdefault("failures", []).append({"message": msg, **details})

    @property
    def message(self) -> str:
        if self.ok:
            return f"agree (worst relative drift {self.drift:.2g})"
        more = f" (+{len(self.failures) - 1} more)" if len(self.failures) > 1 else ""
        return self.failures[0] + more


def drift(got: float, want: float, tol) -> float:
    """Relative deviation, with values smaller than the scale where ``atol`` dominates
    (atol / rtol) measured against that scale: a 1e-17 loss that is 3e-17 is not "200% off"."""
    scale = max(abs(want), tol.atol / tol.rtol if tol.rtol > 0 else 0.0, 1e-300)
    return abs(got - want) / scale


def compare_runs(scn: Scenario, got: VariantRun, want: VariantRun, *, mask: torch.Tensor,
                 row_map: torch.Tensor | None = None, metrics: list[str] | None = None,
                 tokens: tuple[str, ...] = COMPARED_TOKENS, params: bool = True,
                 metric_names_equal: bool = True, steps: int | None = None,
                 width: int | None = None, label: str = "") -> Comparison:
    """Does ``got`` agree with ``want``?

    mask [B, R]: valid tokens of ``want``'s batch. row_map [B]: ``got``'s row i is ``want``'s row
    row_map[i] (permutation invariants). width: compare only the first ``width`` response columns
    of ``got`` (padding-appended invariant). metrics: names to compare (default: every golden-able
    metric of ``want``).
    """
    c = Comparison()
    n_steps = min(len(got.steps), len(want.steps)) if steps is None else steps
    pre = f"{label}: " if label else ""
    for step in range(n_steps):
        g, w = got.steps[step], want.steps[step]
        if metric_names_equal:
            gn, wn = set(golden_names(g)), set(golden_names(w))
            if gn != wn:
                c.fail(f"{pre}step {step}: metric names differ: only in one run "
                       f"{sorted(gn ^ wn)}", only_got=sorted(gn - wn), only_want=sorted(wn - gn))
        for name in (metrics if metrics is not None else golden_names(w)):
            if name not in w:
                continue
            if name not in g:
                c.fail(f"{pre}step {step}: metric {name} missing")
                continue
            tol = scn.tol(name)
            c.drift = max(c.drift, drift(g[name], w[name], tol))
            if not tol.close(g[name], w[name]):
                c.fail(f"{pre}step {step}: {name} = {g[name]:.10g}, expected {w[name]:.10g} "
                       f"(rtol={tol.rtol:g}, atol={tol.atol:g})", metric=name, step=step,
                       got=g[name], want=w[name])
    for name in tokens:
        if name not in want.tokens or name not in got.tokens:
            if (name in want.tokens) != (name in got.tokens):
                c.fail(f"{pre}per-token {name} present in only one run")
            continue
        gt = got.tokens[name]
        if width is not None:
            gt = gt[:, :width]
        if row_map is not None:
            back = torch.empty_like(gt)
            back[row_map] = gt
            gt = back
        ok, msg, det = compare_tensors(name, gt, want.tokens[name], scn.tol(name), mask)
        if not ok:
            c.fail(f"{pre}{msg}", tensor=name, **det)
    if params and got.params and want.params:
        for step in range(min(len(got.params), len(want.params), n_steps)):
            if got.param_names != want.param_names:
                c.fail(f"{pre}parameter names differ")
                break
            ok, msg, det = compare_tensors(f"parameters after step {step}", got.params[step],
                                           want.params[step], scn.tol("params"))
            if not ok:
                idx = det.get("worst", [{}])[0].get("index", [0])[0]
                c.fail(f"{pre}{msg} (in {_param_of(want, idx)})", **det)
    return c


def _param_of(run: VariantRun, flat_index: int) -> str:
    """Name of the parameter that flat index ``flat_index`` of run.params falls in."""
    offset = 0
    for name, numel in zip(run.param_names, run.param_numels):
        if flat_index < offset + numel:
            return f"{name}[{flat_index - offset}]"
        offset += numel
    return f"element {flat_index}"
