"""Comparing two runs (metrics per step, per-token tensors, updated parameters) within a
scenario's tolerances: the workhorse of the metamorphic and parity invariants."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from rlaudit.backends.base import VariantRun
from rlaudit.metrics import golden_names
from rlaudit.scenarios.invariants.base import compare_tensors
from rlaudit.scenarios.spec import Scenario

#: how many times the measured noise floor (``VariantRun.noise``: the reference replayed with its
#: weights perturbed at a target's precision) a comparison allows on top of its tolerance. One
#: draw is pooled over every metric of a step, every entry of a tensor, every element of a
#: parameter tensor, so a factor of 10 covers a second, independent draw (the target's own
#: rounding: measured 0.2-3x the perturbed reference's spread on the toy trainer) with room,
#: while an injected bug moves results by 1e-3 relative at step 0, where the floor is ~1e-7.
NOISE_FACTOR = 10.0
#: metrics smaller than this are measured against it when pooling relative spreads
NOISE_METRIC_SCALE = 1e-3

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
        self.details.setdefault("failures", []).append({"message": msg, **details})

    def fail_tensor(self, msg: str, tol, **details) -> None:
        """A failed per-token or parameter comparison: its worst entries count in ``drift`` (the
        "worst drift" a failing row shows would otherwise be the metrics' alone)."""
        self.fail(msg, **details)
        for w in details.get("worst", []):
            d = drift(w["got"], w["want"], tol)
            if math.isfinite(d):
                self.drift = max(self.drift, d)

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
    noise = want.noise
    for step in range(n_steps):
        g, w = got.steps[step], want.steps[step]
        rel_noise = _metric_noise(w, noise.steps[step]) if noise and step < len(
            noise.steps) else 0.0
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
            slack = NOISE_FACTOR * rel_noise * max(abs(w[name]), NOISE_METRIC_SCALE)
            if abs(g[name] - w[name]) > tol.atol + tol.rtol * abs(w[name]) + slack:
                floor = f", noise floor {slack:.2g}" if slack else ""
                c.fail(f"{pre}step {step}: {name} = {g[name]:.10g}, expected {w[name]:.10g} "
                       f"(rtol={tol.rtol:g}, atol={tol.atol:g}{floor})", metric=name, step=step,
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
        slack = 0.0
        if noise is not None and name in noise.tokens:
            spread = (noise.tokens[name].double() - want.tokens[name].double()).abs()
            spread = torch.where(mask.bool(), spread, 0.0) if mask.shape == spread.shape else spread
            slack = NOISE_FACTOR * float(spread.max()) if spread.numel() else 0.0
        ok, msg, det = compare_tensors(name, gt, want.tokens[name], scn.tol(name), mask,
                                       slack=slack)
        if not ok:
            c.fail_tensor(f"{pre}{msg}", scn.tol(name), tensor=name, **det)
    if params and got.params and want.params:
        for step in range(min(len(got.params), len(want.params), n_steps)):
            if got.param_names != want.param_names:
                c.fail(f"{pre}parameter names differ")
                break
            if noise is not None and step < len(noise.params):
                _compare_params_l2(c, pre, step, want, got.params[step], want.params[step],
                                   noise.params[step], scn.tol("params"))
                continue
            ok, msg, det = compare_tensors(f"parameters after step {step}", got.params[step],
                                           want.params[step], scn.tol("params"))
            if not ok:
                idx = det.get("worst", [{}])[0].get("index", [0])[0]
                c.fail_tensor(f"{pre}{msg} (in {_param_of(want, idx)})", scn.tol("params"),
                              step=step, **det)
    return c


def _compare_params_l2(c: Comparison, pre: str, step: int, run: VariantRun, got: torch.Tensor,
                       want: torch.Tensor, noisy: torch.Tensor, tol) -> None:
    """Parameters against a noise floor, per named tensor in L2: ||got - want|| <= atol *
    sqrt(numel) + rtol * ||want|| + NOISE_FACTOR * ||noisy - want|| (the whole model's spread).

    Not elementwise: rounding moves a few elements a lot where an update is unstable (AdamW
    divides near-zero gradients by their own size: an element whose true gradient is ~1e-8 gets
    an O(lr) update whichever way rounding tips it), and which elements those are differs from
    one rounding to the next; an L2 norm over a tensor is stable, and a bug that changes an
    update's direction moves a whole tensor by ~lr * sqrt(numel)."""
    floor = NOISE_FACTOR * float((noisy.double() - want.double()).norm())
    worst, bad, offset = None, [], 0
    for name, numel in zip(run.param_names, run.param_numels):
        g, w = got[offset:offset + numel].double(), want[offset:offset + numel].double()
        offset += numel
        dist = float((g - w).norm())
        bound = tol.atol * numel ** 0.5 + tol.rtol * float(w.norm()) + floor
        if dist > bound:
            bad.append(name)
            if worst is None or dist / bound > worst[1] / worst[2]:
                worst = (name, dist, bound)
    if bad:
        name, dist, bound = worst
        c.fail(f"{pre}parameters after step {step}: {len(bad)} tensor(s) out of tolerance in L2 "
               f"(rtol={tol.rtol:g}, atol={tol.atol:g} per element, noise floor {floor:.2g}); "
               f"worst {name}: |got - want| = {dist:.3g} > {bound:.3g}", tensors=bad[:20],
               step=step)


def _metric_noise(want: dict, noisy: dict) -> float:
    """The relative spread of one step's metrics under the noise perturbation, pooled: the
    largest |noisy - want| / max(|want|, NOISE_METRIC_SCALE) over every compared metric."""
    rel = 0.0
    for name in golden_names(want):
        if name in noisy:
            rel = max(rel, abs(noisy[name] - want[name]) / max(abs(want[name]),
                                                                 NOISE_METRIC_SCALE))
    return rel


def _param_of(run: VariantRun, flat_index: int) -> str:
    """Name of the parameter that flat index ``flat_index`` of run.params falls in."""
    offset = 0
    for name, numel in zip(run.param_names, run.param_numels):
        if flat_index < offset + numel:
            return f"{name}[{flat_index - offset}]"
        offset += numel
    return f"element {flat_index}"
