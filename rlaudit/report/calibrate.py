"""Golden tolerances from the spread of repeated runs (hardware that is not bitwise deterministic:
GPU kernels with atomics, NCCL reductions, bf16).

**The rule** (per metric, over the training steps ``s`` of ``N >= 2`` repeats):

    m_s = median of the N values at step s,   d_s = max over repeats of |v - m_s|
    a step is *value-dominated* when d_s <= NOISE_DOMINATED * |m_s|: it bounds the relative spread
        rtol = max(rtol_floor, safety * max_s d_s / |m_s|)       (value-dominated steps)
    otherwise the value is noise around zero (an on-policy ppo_kl of 1e-9 +- 1e-9): it bounds the
    absolute spread
        atol = max(atol_floor, safety * max_s d_s)               (noise-dominated steps)

Steps with d_s = 0 add nothing, so a bitwise-deterministic metric gets the floors. Each repeat
then satisfies the golden check ``|v - m| <= atol + rtol * |m|`` with a ``safety`` margin.

    tols = propose_tolerances([run1_steps, run2_steps, run3_steps])
    calib = calibrate_scenario(load_scenario("scenarios/x.yaml"), runs=5)
    doc = apply_tolerances(json.load(open("golden/x.json")), calib)   # per backend
    doc = apply_tolerances(doc, calib["tolerances"])                    # or one set for all
"""

from __future__ import annotations

import copy
import dataclasses
import math
import statistics
from pathlib import Path
from typing import Any

from rlaudit.backends import memo
from rlaudit.errors import CheckFailed, InputError
from rlaudit.metrics import golden_names
from rlaudit.scenarios import engine
from rlaudit.scenarios.golden import backend_key
from rlaudit.scenarios.spec import Scenario, load_scenario

#: the max deviation of a handful of repeats underestimates the true spread; x5 keeps false
#: alarms rare while still catching a real change (a bug moves metrics by far more)
SAFETY = 5.0
#: a spread above 1% of the value means the value is noise around zero: it sets atol, not rtol
NOISE_DOMINATED = 1e-2
#: floors, so that a deterministic metric does not get a zero tolerance that the next BLAS
#: build's different summation order breaks (a few float64 ulps, relative and absolute)
RTOL_FLOOR = 1e-9
ATOL_FLOOR = 1e-12


def propose_tolerances(runs: list[list[dict[str, float]]], *, safety: float = SAFETY,
                       rtol_floor: float = RTOL_FLOOR, atol_floor: float = ATOL_FLOOR
                       ) -> dict[str, dict[str, float]]:
    """``runs[r][s][metric]``: repeat r, training step s. Every repeat must have the same steps
    and metric names, all finite. Returns {metric: {"rtol": ..., "atol": ...}} (module doc)."""
    if len(runs) < 2:
        raise InputError(f"need at least 2 repeated runs to measure a spread, got {len(runs)}",
                         key="runs")
    if not safety > 0:
        raise InputError(f"safety must be > 0, got {safety}", key="safety")
    n_steps = len(runs[0])
    for r, run in enumerate(runs):
        if len(run) != n_steps:
            raise InputError(f"repeat {r} has {len(run)} steps, repeat 0 has {n_steps}",
                             key="runs")
        for s, step in enumerate(run):
            if set(step) != set(runs[0][s]):
                diff = sorted(set(step) ^ set(runs[0][s]))
                raise InputError(f"repeat {r} step {s} logs different metrics than repeat 0: "
                                 f"{diff}", key="runs")
            for name, v in step.items():
                if not math.isfinite(v):
                    raise InputError(f"{name} is {v} in repeat {r} step {s}", key=name)
    out = {}
    for name in sorted({n for step in runs[0] for n in step}):
        rel, ab = 0.0, 0.0
        for s in range(n_steps):
            values = [run[s][name] for run in runs]
            m = statistics.median(values)
            d = max(abs(v - m) for v in values)
            if d == 0:
                continue
            if d <= NOISE_DOMINATED * abs(m):
                rel = max(rel, d / abs(m))
            else:
                ab = max(ab, d)
        out[name] = {"rtol": max(rtol_floor, safety * rel), "atol": max(atol_floor, safety * ab)}
    return out


def calibrate_scenario(scenario, *, runs: int, backends: list[str] | None = None,
                       safety: float = SAFETY) -> dict[str, Any]:
    """Run ``scenario`` (a Scenario or a scenario file) ``runs`` times on its backends (only the
    baseline variant: invariants are switched off, their variants do not feed goldens) and
    propose tolerances for every golden-compared metric.

    Returns {"scenario", "runs", "safety", "backends": {"<backend>@<device>": {metric: tol}},
    "tolerances": {metric: tol}} where "tolerances" takes each metric's loosest rtol and atol
    over the backends (one golden file serves them all)."""
    if runs < 2:
        raise InputError(f"--runs must be at least 2 to measure a spread, got {runs}",
                         key="--runs")
    scn = scenario if isinstance(scenario, Scenario) else load_scenario(Path(scenario))
    base_only = dataclasses.replace(scn, invariants=[])
    repeats: dict[str, list[list[dict[str, float]]]] = {}
    for k in range(runs):
        with memo.disabled():   # a repeat is a measurement: never the first run's memoised copy
            res = engine.run_scenario(base_only, backends=backends, golden_dir=None)
        if res.errors:
            b, err = next(iter(res.errors.items()))
            raise CheckFailed(f"{scn.name}: backend {b} failed in repeat {k + 1}/{runs}: "
                              f"{err.splitlines()[0] if err else 'error'}")
        for b, steps in res.metrics.items():
            repeats.setdefault(b, []).append(
                [{n: float(step[n]) for n in golden_names(step)} for step in steps])
    if not repeats:
        raise InputError(f"no backend of scenario {scn.name} is available here",
                         source=str(scn.path), key="backends")
    per_backend = {backend_key(b, scn.device): propose_tolerances(reps, safety=safety)
                   for b, reps in sorted(repeats.items())}
    merged: dict[str, dict[str, float]] = {}
    for tols in per_backend.values():
        for name, t in tols.items():
            cur = merged.setdefault(name, dict(t))
            cur["rtol"], cur["atol"] = max(cur["rtol"], t["rtol"]), max(cur["atol"], t["atol"])
    return {"scenario": scn.name, "runs": runs, "safety": safety, "backends": per_backend,
            "tolerances": merged}


def apply_tolerances(golden_doc: dict, tolerances: dict, *,
                     backends: list[str] | None = None) -> dict:
    """A copy of ``golden_doc`` (rlaudit/scenarios/golden.py's format) whose entries for the
    calibrated metrics carry the new rtol/atol at every step. Values are untouched; metrics the
    golden does not have are ignored; ``golden_doc`` is not modified.

    ``tolerances`` is either flat, ``{metric: {"rtol", "atol"}}``, applied to ``backends``
    (golden keys like ``fsdp@cuda`` or bare backend names; default: all), or the whole output of
    :func:`calibrate_scenario`, whose per-backend proposals go to the matching golden keys only
    (backends that were not calibrated keep their tolerances)."""
    if isinstance(tolerances.get("backends"), dict) and "tolerances" in tolerances:
        doc = golden_doc
        for key, tols in tolerances["backends"].items():
            if key in golden_doc.get("backends", {}) and (backends is None or key in backends
                                                          or key.split("@")[0] in backends):
                doc = apply_tolerances(doc, tols, backends=[key])
        return copy.deepcopy(doc) if doc is golden_doc else doc
    for name, t in tolerances.items():
        for k in ("rtol", "atol"):
            v = t.get(k) if isinstance(t, dict) else None
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not v >= 0 \
                    or not math.isfinite(v):
                raise InputError(f"{k} must be a finite number >= 0, got {v!r}", key=name)
    doc = copy.deepcopy(golden_doc)
    entries = doc.get("backends")
    if not isinstance(entries, dict):
        raise InputError("golden document has no 'backends' mapping", key="backends")
    keys = list(entries)
    if backends is not None:
        unknown = [b for b in backends if b not in entries and
                   not any(k.split("@")[0] == b for k in keys)]
        if unknown:
            raise InputError(f"golden has no backend {unknown} (it has: {', '.join(keys)})",
                             key="backends")
        keys = [k for k in keys if k in backends or k.split("@")[0] in backends]
    for key in keys:
        for step in entries[key].get("steps", []):
            for name, t in tolerances.items():
                if name in step:
                    step[name]["rtol"] = float(t["rtol"])
                    step[name]["atol"] = float(t["atol"])
    return doc
