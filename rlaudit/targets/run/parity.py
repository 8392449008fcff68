"""Run-level invariants for a target: each invariant checked with the target as one backend and
the reference as the oracle; parity compares each variant on its own mask, the reference narrowed
to what the target reports (its per-token tensors, parameters, and the metric names it logs in
any variant); failures covered by declared differences become ``differs``.
"""

from __future__ import annotations

import dataclasses
import traceback

from rlaudit.metrics import CLIP_UNDECIDED, golden_names
from rlaudit.scenarios.invariants import INVARIANTS, CheckContext
from rlaudit.scenarios.invariants.metamorphic import cut_invariant_metrics
from rlaudit.scenarios.invariants.parity import ORACLE
from rlaudit.targets.contract.declare import Declarations
from rlaudit.targets.run.target_backend import missing
from rlaudit.verdict.compare import compare_runs
from rlaudit.verdict.result import DIFFERS, ERROR, FAIL, NA, PASS, CheckResult
from rlaudit.verdict.unsupported import UnsupportedFeature, unsupported_result

#: invariants that compare the target with the reference run by run
PARITY_INVARIANTS = ("backend-parity", "dp-invariance")


def apply_differences(results: list[CheckResult], target: str, decl: Declarations
                      ) -> list[CheckResult]:
    """A failing result of ``target`` whose every problem is a declared difference (without a
    convention) becomes ``differs``; any undeclared problem keeps it a failure, and its message
    then leads with the undeclared ones (a declared problem first would read as the known
    difference again and hide what turned the check red)."""
    out = []
    for r in results:
        if r.status != FAIL or r.backend != target or not decl.differences:
            out.append(r)
            continue
        problems = [f["message"] for f in r.details.get("failures", [])
                    if isinstance(f, dict) and f.get("message")] or [r.message]
        found, undeclared = {}, []
        for p in problems:
            d = decl.declared(r.invariant, p)
            if d is None and r.invariant == "dp-invariance":
                # the same comparison with the same reference, over more ranks: what the
                # target declared against the reference holds there too
                d = decl.declared("backend-parity", p)
            if d is None:
                undeclared.append(p)
            else:
                found.setdefault(d.name, (d, []))[1].append(p)
        if not found:
            out.append(r)
            continue
        details = {**r.details, "differences": {
            n: {"declared": d.describe(), "count": len(ps), "problems": ps[:10]}
            for n, (d, ps) in found.items()}}
        declared = "; ".join(f"{n} ({len(ps)} problem(s))" for n, (_, ps) in found.items())
        if undeclared:
            more = f" (+{len(undeclared) - 1} more)" if len(undeclared) > 1 else ""
            details["undeclared"] = undeclared
            msg = (f"{len(undeclared)} undeclared problem(s): {undeclared[0]}{more}; "
                   f"besides as declared: {declared}")
            out.append(dataclasses.replace(r, message=msg, details=details))
            continue
        msg = "as declared: " + "; ".join(f"{n} ({len(ps)} problem(s), e.g. {ps[0]})"
                                          for n, (_, ps) in found.items())
        out.append(dataclasses.replace(r, status=DIFFERS, message=msg, details=details))
    return out


def check_invariant(inv_name: str, ctx: CheckContext, target: str, adapter: object,
                    skipped: dict[str, str],
                    unsupported: dict[str, UnsupportedFeature] | None = None
                    ) -> list[CheckResult]:
    """One invariant: n/a for the target when it lacks a variant or data (the reference is still
    checked), ``unsupported`` when every variant it lacks is one the release cannot run
    (``unsupported``: variant name -> the adapter's exception); parity invariants compare the
    target with the reference (:func:`target_parity`)."""
    unsupported = unsupported or {}
    inv = INVARIANTS.get(inv_name)
    out: list[CheckResult] = []
    runs = ctx.runs.get(target)
    sub = ctx
    if runs is not None:
        universe = metric_universe(runs, adapter)
        needed = [v.name for v in inv.variants(ctx.scenario, ctx.batch)] or ["base"]
        absent = [v for v in needed if v not in runs]
        present = [v for v in needed if v in runs]
        if absent and present and (inv.alternatives or (
                inv.partial and needed[0] in runs and len(present) >= 2)):
            # alternatives (to a baseline, needed[0], or without one): check the variants the
            # target ran; the invariant names the others n/a in its message
            needed, absent = present, []
        configs = {v.name: v.config for v in ctx.variants}
        why = ("variant(s) not run by the target: " + "; ".join(
            f"{v} ({skipped.get(v, 'not returned')})" for v in absent[:2])
               if absent else missing(inv_name, {v: runs[v] for v in needed}, configs, universe))
        if why:
            lacked = {v: unsupported[v] for v in absent if v in unsupported}
            out.append(unsupported_result(inv_name, target, lacked, note=f" (variant(s) "
                                          f"{', '.join(absent[:3])})")
                       if absent and len(lacked) == len(absent)
                       else CheckResult(inv_name, target, NA, why))
            sub = dataclasses.replace(ctx, runs={b: r for b, r in ctx.runs.items()
                                                 if b != target})
        elif inv_name in PARITY_INVARIANTS:
            return [target_parity(inv_name, ctx, target, universe)]
    if not sub.runs:
        return out
    try:
        return out + inv.check(sub)
    except Exception as e:
        return out + [CheckResult(inv_name, "*", ERROR, f"the check raised {type(e).__name__}: "
                                  f"{e}", {"traceback": traceback.format_exc()})]


def target_parity(inv_name: str, ctx: CheckContext, target: str,
                  universe: set[str]) -> CheckResult:
    """backend-parity (and dp-invariance, when the target's layout has dp > 1) for a target:
    every variant both ran, compared with :func:`compare_runs` on that variant's own mask, the
    reference narrowed to what the target reports (:func:`narrowed_reference`)."""
    if inv_name == "dp-invariance" and ctx.scenario.backends[target].get("dp", 1) <= 1:
        return CheckResult(inv_name, target, NA, "the target's layout has dp = 1")
    if ORACLE not in ctx.runs:
        return CheckResult(inv_name, target, NA, "the reference backend did not run")
    got, ref = ctx.runs[target], narrowed_reference(ctx.runs[ORACLE], ctx.runs[target], universe)
    masks = {v.name: v.batch.mask for v in ctx.variants}
    failures, details, drift = [], {}, 0.0
    common = [v for v in got if v in ref]
    for v in common:
        # a target laid out over several DP ranks cuts micro-batches unlike the one-rank
        # reference: metrics reduced as micro-batch means then differ by definition
        metrics = (cut_invariant_metrics(ctx.scenario, ref[v])
                   if ctx.scenario.backends[target].get("dp", 1) > 1 else None)
        c = compare_runs(ctx.scenario, got[v], ref[v], mask=masks[v], metrics=metrics,
                         label=f"variant {v}")
        drift = max(drift, c.drift)
        failures += c.failures
        details.setdefault("failures", []).extend(c.details.get("failures", []))
    never = sorted({n for r in ctx.runs[ORACLE].values() for s in r.steps
                    for n in golden_names(s)} - universe)
    if never:
        details["not_compared"] = never
    note = (f" [not compared, never logged by {target}: {', '.join(never[:4])}"
            f"{' ...' if len(never) > 4 else ''}]") if never else ""
    if failures:
        more = f" (+{len(failures) - 1} more)" if len(failures) > 1 else ""
        return CheckResult(inv_name, target, FAIL, failures[0] + more + note, details, drift)
    return CheckResult(inv_name, target, PASS, f"{len(common)} variant(s) agree with {ORACLE} "
                       f"(worst relative drift {drift:.2g}){note}", details, drift)


def metric_universe(runs: dict, adapter: object) -> set[str]:
    """Every metric name the target logged in any variant, plus its declared metric_names."""
    names = set(getattr(adapter, "metric_names", None) or ())
    for run in runs.values():
        for step in run.steps:
            names.update(step)
    return names


def narrowed_reference(ref_runs: dict, target_runs: dict, universe: set[str]) -> dict:
    """The reference's runs restricted to the target's reported data: per variant, the per-token
    tensors and parameters the target returned; metrics named in ``universe``, and the
    bookkeeping the clip fractions' tolerance reads (CLIP_UNDECIDED: never compared itself)."""
    out = {}
    for v, run in ref_runs.items():
        t = target_runs.get(v)
        keep = set(t.tokens) if t is not None else set()
        out[v] = dataclasses.replace(
            run, tokens={k: x for k, x in run.tokens.items() if k in keep},
            steps=[{k: x for k, x in s.items() if k in universe or k == CLIP_UNDECIDED}
                   for s in run.steps],
            params=run.params if t is not None and t.params else [])
    return out
