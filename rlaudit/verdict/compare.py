"""Comparing two runs (metrics per step, per-token tensors, updated parameters) within a
scenario's tolerances: the workhorse of the metamorphic and parity invariants."""

from __future__ import annotations

import contextlib
import dataclasses
import math
from dataclasses import dataclass, field

import torch

from rlaudit.backends.base import VariantRun
from rlaudit.metrics import CLIP_UNDECIDED, counted, golden_bound, golden_names
from rlaudit.verdict.tensors import compare_tensors
from rlaudit.verdict.tolerance import Tolerances

#: how many times the measured noise floor (``VariantRun.noise``: the reference replayed with its
#: weights perturbed at a target's precision) a comparison allows on top of its tolerance. One
#: draw is pooled over every metric of a step, every entry of a tensor, every element of a
#: parameter tensor, so a factor of 10 covers a second, independent draw (the target's own
#: rounding: measured 0.2-3x the perturbed reference's spread on the toy trainer) with room,
#: while an injected bug moves results by 1e-3 relative at step 0, where the floor is ~1e-7.
NOISE_FACTOR = 10.0
#: metrics smaller than this are measured against it when pooling relative spreads
NOISE_METRIC_SCALE = 1e-3

#: a comparison against a measured floor that fails by at most this many times its bound is a
#: near miss: another draw of the same noise may show the floor wider (one draw's spread was
#: measured to vary 10x between draws where clipping amplifies rounding: a bf16 trainer's
#: ppo_dual_clip grad norm, 0.034-0.32 relative over six draws), so the target runner measures
#: the floor again (rlaudit/targets/run/runner.py); a bug misses by orders of magnitude more
NEAR_MISS = 4.0

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


def compare_runs(scn: Tolerances, got: VariantRun, want: VariantRun, *, mask: torch.Tensor,
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
    undecided = _undecided_tokens(want, want.noise, mask) if want.noise is not None else 0.0
    for step in range(n_steps):
        _compare_step_metrics(c, scn, got, want, step, pre=pre, metrics=metrics,
                              names_equal=metric_names_equal, undecided=undecided)
    for name in tokens:
        _compare_token_tensor(c, scn, got, want, name, pre=pre, mask=mask, row_map=row_map,
                              width=width)
    if params and got.params and want.params:
        _compare_params(c, scn, got, want, n_steps, pre=pre)
    return c


def _compare_step_metrics(c: Comparison, scn: Tolerances, got: VariantRun, want: VariantRun,
                          step: int, *, pre: str, metrics: list[str] | None, names_equal: bool,
                          undecided: float) -> None:
    """One step's metrics of ``got`` against ``want``'s, each within its tolerance plus the
    measured noise floor (when ``want`` carries one); failures are recorded on ``c``."""
    g, w = got.steps[step], want.steps[step]
    noise = want.noise
    noisy = noise.steps[step] if noise and step < len(noise.steps) else None
    rel_noise = _metric_noise(w, noisy) if noisy is not None else 0.0
    count_noise = _count_noise(w, noisy) if noisy is not None else 0.0
    # tokens whose ratio the reference saw within rounding of a clip bound: a correct trainer in
    # a lower precision (one compared against a noise floor) may clip each either way
    near_bound = float(w.get(CLIP_UNDECIDED, 0.0)) if noisy is not None else 0.0
    if names_equal:
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
        if counted(name):
            slack = max(slack, NOISE_FACTOR * count_noise,
                        undecided + near_bound if counted(name) == "signed" else 0.0)
        bound = golden_bound(w[name], tol.rtol, tol.atol) + slack
        if abs(g[name] - w[name]) > bound:
            if noisy is not None:
                _missed_by(_ratio(abs(g[name] - w[name]), bound))
            floor = f", noise floor {slack:.2g}" if slack else ""
            c.fail(f"{pre}step {step}: {name} = {g[name]:.10g}, expected {w[name]:.10g} "
                   f"(rtol={tol.rtol:g}, atol={tol.atol:g}{floor})", metric=name, step=step,
                   got=g[name], want=w[name])


def _compare_token_tensor(c: Comparison, scn: Tolerances, got: VariantRun, want: VariantRun,
                          name: str, *, pre: str, mask: torch.Tensor,
                          row_map: torch.Tensor | None, width: int | None) -> None:
    """Per-token tensor ``name`` [B, R] of ``got`` (its first ``width`` columns, its rows put
    back in ``want``'s order by ``row_map``) against ``want``'s where ``mask`` [B, R] is True;
    a tensor present in one run only fails, one in neither is skipped."""
    if name not in want.tokens or name not in got.tokens:
        if (name in want.tokens) != (name in got.tokens):
            c.fail(f"{pre}per-token {name} present in only one run")
        return
    gt = got.tokens[name]
    if width is not None:
        gt = gt[:, :width]
    if row_map is not None:
        back = torch.empty_like(gt)
        back[row_map] = gt
        gt = back
    noise = want.noise
    slack = 0.0
    if noise is not None and name in noise.tokens:
        slack = NOISE_FACTOR * masked_spread(noise.tokens[name], want.tokens[name], mask)
    ok, msg, det = compare_tensors(name, gt, want.tokens[name], scn.tol(name), mask, slack=slack)
    if not ok and noise is not None:
        _missed_by(det.get("missed_by", math.inf))
    if not ok:
        c.fail_tensor(f"{pre}{msg}", scn.tol(name), tensor=name, **det)


def _compare_params(c: Comparison, scn: Tolerances, got: VariantRun, want: VariantRun,
                    n_steps: int, *, pre: str) -> None:
    """The parameters after each of the first ``n_steps`` steps: elementwise, or per named
    tensor in L2 against the noise floor when ``want`` carries one (:func:`_compare_params_l2`)."""
    noise = want.noise
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
        _missed_by(_ratio(dist, bound))
        c.fail(f"{pre}parameters after step {step}: {len(bad)} tensor(s) out of tolerance in L2 "
               f"(rtol={tol.rtol:g}, atol={tol.atol:g} per element, noise floor {floor:.2g}); "
               f"worst {name}: |got - want| = {dist:.3g} > {bound:.3g}", tensors=bad[:20],
               step=step)


def _metric_noise(want: dict, noisy: dict) -> float:
    """The relative spread of one step's metrics under the noise perturbation, pooled: the
    largest |noisy - want| / max(|want|, NOISE_METRIC_SCALE) over every compared metric that
    varies continuously. A counted fraction (``MetricSpec.counted``: a clip fraction) is left
    out: rounding that tips one token over a clip bound moves it by a whole count -- 1/196 on a
    fraction of 0 is "100 %" --, which pooled would widen every other metric's bound by ten
    times its own value; those pool their own spread instead (:func:`_count_noise`)."""
    rel = 0.0
    for name in golden_names(want):
        if name in noisy and not counted(name):
            rel = max(rel, abs(noisy[name] - want[name]) / max(abs(want[name]),
                                                                 NOISE_METRIC_SCALE))
    return rel


def _undecided_tokens(want: VariantRun, noise: VariantRun, mask: torch.Tensor) -> float:
    """Slack of the ``counted="signed"`` fractions: the fraction of valid tokens whose advantage
    is within NOISE_FACTOR times the perturbed replay's largest advantage move of 0: its sign is
    rounding's to decide, and with it whether
    the token counts in a clip fraction at all (a ratio outside the clip range counts for
    ``A > 0`` or ``A < 0`` alike, never for ``A = 0``). Measured: a GRPO group whose mean is not
    representable gives two rows 2.2e-7 in float64 and exactly 0 in float32, and a float32
    trainer's clip fractions miss their clipped tokens. An advantage 0 in both runs is left out
    (a group scoring all alike is 0 at any precision). 0.0 without recorded advantages."""
    a, n = want.tokens.get("advantages"), noise.tokens.get("advantages")
    if a is None or n is None or a.shape != n.shape or a.shape != mask.shape:
        return 0.0
    valid = mask.bool()
    if not valid.any():
        return 0.0
    a, n = a.double(), n.double()
    spread = masked_spread(n, a, valid)
    # an advantage 0 in both runs is 0 at every precision (a group scoring all alike): decided
    near = valid & (a.abs() <= NOISE_FACTOR * spread) & ((a != 0) | (n != 0))
    return float(near.sum()) / float(valid.sum())


def masked_spread(noisy: torch.Tensor, want: torch.Tensor, mask: torch.Tensor) -> float:
    """The largest |noisy - want| over the entries ``mask`` marks valid (every entry when the
    shapes differ); 0.0 for an empty tensor. A per-token tensor's measured noise spread."""
    spread = (noisy.double() - want.double()).abs()
    if mask.shape == spread.shape:
        spread = torch.where(mask.bool(), spread, 0.0)
    return float(spread.max()) if spread.numel() else 0.0


# ---- near misses and more draws ------------------------------------------------------------------
_watchers: list[dict] = []


@contextlib.contextmanager
def near_misses():
    """Within the block, record how far the comparisons against a measured floor fail: yields
    ``{"worst": r}``, the largest |got - want| / bound of those failures (0.0: none failed;
    inf: a failure without a finite ratio). The target runner measures the floor again when
    ``0 < worst <= NEAR_MISS``."""
    box = {"worst": 0.0}
    _watchers.append(box)
    try:
        yield box
    finally:
        _watchers.remove(box)


def _ratio(off: float, bound: float) -> float:
    """How many times its bound a failing comparison is off (inf: a zero bound; a NaN is made
    inf by :func:`_missed_by`)."""
    return off / bound if bound > 0 else math.inf


def _missed_by(ratio: float) -> None:
    """Record a failure ``ratio`` times its bound with every watcher (NaN counts as inf)."""
    for box in _watchers:
        box["worst"] = max(box["worst"], ratio if math.isfinite(ratio) else math.inf)


def widest(want: VariantRun, a: VariantRun, b: VariantRun) -> VariantRun:
    """One noise run standing for two draws ``a`` and ``b`` of the perturbed replay of ``want``:
    every metric, per-token entry and parameter element at ``want`` plus the larger of the two
    draws' distances from it, so each spread the comparisons read (pooled maxima, per-tensor
    maxima, an L2 norm) is at least the larger draw's."""
    def far(w, x, y):
        return w + torch.maximum((x - w).abs(), (y - w).abs())

    steps = []
    for i, sa in enumerate(a.steps):
        sb = b.steps[i] if i < len(b.steps) else {}
        sw = want.steps[i] if i < len(want.steps) else {}
        steps.append({k: (sw[k] + max(abs(v - sw[k]), abs(sb[k] - sw[k]))
                          if k in sb and k in sw and isinstance(v, (int, float)) else v)
                      for k, v in sa.items()})
    tokens = {}
    for k, t in a.tokens.items():
        u, w = b.tokens.get(k), want.tokens.get(k)
        same = (u is not None and w is not None and t.shape == u.shape == w.shape
                and t.is_floating_point())
        tokens[k] = far(w.double(), t.double(), u.double()) if same else t
    params = [far(want.params[i].double(), p.double(), b.params[i].double())
              if i < len(b.params) and i < len(want.params) and p.shape == b.params[i].shape
              else p for i, p in enumerate(a.params)]
    return dataclasses.replace(a, steps=steps, tokens=tokens, params=params)


def moved_onto(noisy: VariantRun, ref: VariantRun, onto: VariantRun) -> VariantRun:
    """The reference's perturbed replay ``noisy`` of a variant, its distances from the
    reference's own run ``ref`` of it laid onto another backend's run ``onto`` of the same
    variant: every metric, per-token entry and parameter element at ``onto``'s value plus
    ``|noisy - ref|``. A comparison between two runs of that backend (a metamorphic relation,
    ``onto`` its ``want``) then allows the spread rounding causes -- not ``onto``'s distance from
    the reference, which a bug makes large (a trainer clipping each micro-batch's gradient
    would pass microbatch-invariance at a relative drift of 1.0, its own 0.63 from the
    reference allowed ten times). What ``onto`` has and the reference's runs lack, or
    holds in another shape, gets no noise."""
    def moved(o, n, r):
        return o.double() + (n.double() - r.double()).abs()

    steps = []
    for i, so in enumerate(onto.steps):
        sn = noisy.steps[i] if i < len(noisy.steps) else {}
        sr = ref.steps[i] if i < len(ref.steps) else {}
        steps.append({k: v + abs(sn[k] - sr[k]) for k, v in so.items()
                      if k in sn and k in sr and isinstance(v, (int, float))
                      and isinstance(sn[k], (int, float)) and isinstance(sr[k], (int, float))})
    tokens = {}
    for k, t in onto.tokens.items():
        n, r = noisy.tokens.get(k), ref.tokens.get(k)
        if (n is not None and r is not None and t.shape == n.shape == r.shape
                and t.is_floating_point() and n.is_floating_point()):
            tokens[k] = moved(t, n, r)
    params = []
    for i, p in enumerate(onto.params):
        n = noisy.params[i] if i < len(noisy.params) else None
        r = ref.params[i] if i < len(ref.params) else None
        if n is None or r is None or not p.shape == n.shape == r.shape:
            break       # a step without a comparable floor ends the list (read per step)
        params.append(moved(p, n, r))
    return dataclasses.replace(noisy, steps=steps, tokens=tokens, params=params)


def _count_noise(want: dict, noisy: dict) -> float:
    """The spread of one step's counted fractions under the noise perturbation, pooled: the
    largest |noisy - want| over the metrics ``MetricSpec.counted`` marks. Which tokens sit within
    rounding of a clip bound is the same question for each of them, and one draw tips few of
    them: a float32 trainer's first optimizer steps were measured to flip one token of
    ``pg_clipfrac`` where the perturbed reference flipped one of ``pg_clipfrac_lower``."""
    return max((abs(noisy[n] - want[n]) for n in golden_names(want)
                if n in noisy and counted(n)), default=0.0)


def _param_of(run: VariantRun, flat_index: int) -> str:
    """Name of the parameter that flat index ``flat_index`` of run.params falls in."""
    offset = 0
    for name, numel in zip(run.param_names, run.param_numels):
        if flat_index < offset + numel:
            return f"{name}[{flat_index - offset}]"
        offset += numel
    return f"element {flat_index}"
