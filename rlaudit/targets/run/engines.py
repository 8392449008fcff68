"""Several engines of one target, each its own column: a trainer with more than one training
backend (verl's FSDP and Megatron engines) names them in ``engines``, a tuple of adapters, each
with its own ``name`` (the column), ``train_step`` / ``replay``, ``supports`` and
``metric_names``; the declarations (differences, conventions, tolerances, metric reduction) stay
the target's, so one reference replay serves every column.

Every invariant runs per engine with the reference as the oracle, as for a one-engine target;
then ``engine-parity`` compares each further engine with the first on every variant both ran
(the backend-parity comparison, over the metric names both log and the per-token tensors both
return): backend parity inside the target. An adapter without ``engines`` is its own only
engine, and its results are what they were. An engine may name the only invariants checked on
its column (``checked_invariants``, :func:`own_checks`: one property added to an engine already
checked in full, such as verl's FSDP engine over two ranks for dp-invariance); it then runs only
in scenarios that check one of them, and takes no engine-parity.
"""

from __future__ import annotations

import dataclasses

from rlaudit.scenarios.invariants import CheckContext
from rlaudit.scenarios.invariants.parity import ORACLE
from rlaudit.scenarios.spec import Scenario
from rlaudit.targets.contract.declare import NOISE_SCALE, RUN_TOLERANCES, Declarations
from rlaudit.targets.run.noise import attach_noise_floor, with_noise_floor
from rlaudit.targets.run.parity import apply_differences, check_invariant, metric_universe
from rlaudit.verdict.compare import compare_runs
from rlaudit.verdict.result import FAIL, NA, PASS, CheckResult
from rlaudit.verdict.tolerance import Tolerance

#: the check comparing two engines of one target (reported in the later engine's column)
ENGINE_PARITY = "engine-parity"


def engines_of(adapter: object) -> tuple:
    """The adapter's ``engines`` (each a column), or the adapter itself."""
    engines = tuple(getattr(adapter, "engines", None) or ())
    return engines or (adapter,)


def engine_checks(scn: Scenario, ctx: CheckContext, targets: list, decl: Declarations
                  ) -> list[CheckResult]:
    """Every invariant of ``scn`` per engine (``targets``: TargetBackends; the reference's own
    results once, with the first), declared differences applied, then engine-parity. An engine
    that computes in a coarser precision than its target declares (its own ``train_precision``)
    is checked, and compared with the first, at that precision (:func:`own_precision`)."""
    out: list[CheckResult] = []
    first = targets[0]
    for i, t in enumerate(targets):

        def checks(runs: dict, t=t, i=i) -> list[CheckResult]:
            sub = ctx if len(targets) == 1 else dataclasses.replace(
                ctx, runs={b: r for b, r in runs.items() if b in (t.name, ORACLE)},
                scenario=at_precision(ctx.scenario, t.adapter))
            found = []
            for inv in checked_invariants(scn, t.adapter):
                found += [r for r in apply_differences(
                    check_invariant(inv, sub, t.name, t.adapter, t.skipped, t.unsupported),
                    t.name, decl) if i == 0 or r.backend == t.name]
            if i and not own_checks(t.adapter):
                found.append(engine_parity(at_precision(scn, first.adapter, t.adapter),
                                           dataclasses.replace(ctx, runs=runs), first, t))
            return found

        out += own_precision(scn, ctx, t, decl, checks) if i else checks(ctx.runs)
    return out


def own_checks(adapter: object) -> tuple[str, ...]:
    """The invariants an engine names for itself (``checked_invariants``: a column that adds
    one property to an engine already checked in full, e.g. verl's FSDP engine over two ranks,
    rlaudit/targets/peers/verl_dp.py); empty: every invariant of the scenario, and
    engine-parity with the first engine."""
    return tuple(getattr(adapter, "__dict__", {}).get("checked_invariants") or ())


def checked_invariants(scn: Scenario, adapter: object) -> list[str]:
    """The scenario's invariants that run on ``adapter``'s column (:func:`own_checks`)."""
    own = own_checks(adapter)
    return [i for i in scn.invariants if not own or i in own]


#: per engine name, the context last checked at its own precision and its runs with that
#: precision's noise floor attached (the runner calls engine_checks again after each draw of
#: the target's own floor: the engine's is measured once per scenario)
_OWN_NOISE: dict[str, tuple] = {}


def own_precision(scn: Scenario, ctx: CheckContext, t, decl: Declarations, checks
                  ) -> list[CheckResult]:
    """``checks(runs)`` of engine ``t``: on ``ctx.runs`` as they are, or, when ``t`` declares a
    ``train_precision`` whose noise scale exceeds its target's (verl's bf16 Megatron engine
    beside its float32 FSDP one), on copies of the runs with that precision's noise floor
    (rlaudit/targets/run/noise.py), measured as the runner measures the target's: only when a
    check does not pass without it, up to NOISE_DRAWS draws. The target's own columns keep
    their floor."""
    scale = NOISE_SCALE.get(getattr(t.adapter, "train_precision", None) or "", 0.0)
    if scale <= decl.noise() or ORACLE not in ctx.runs:
        return checks(ctx.runs)
    held = _OWN_NOISE.get(t.name)
    if held is not None and held[0] is ctx:
        return checks(held[1])
    runs = {b: {v: dataclasses.replace(r) for v, r in rs.items()} for b, rs in ctx.runs.items()}
    _OWN_NOISE.clear()
    _OWN_NOISE[t.name] = (ctx, runs)
    return with_noise_floor(checks(runs), lambda: checks(runs), lambda draw: attach_noise_floor(
        runs, scn, ctx.variants, scale, draw=draw))


def at_precision(scn: Scenario, *adapters) -> Scenario:
    """``scn`` with its run-level floor at least that of each engine's own ``train_precision``
    (an engine that computes in another precision than its target declares, e.g. verl's
    Megatron engine in bf16 beside its FSDP engine in float32): the looser one wins, so
    comparing two engines never alarms on the rounding of the coarser."""
    floors = [RUN_TOLERANCES.get(getattr(a, "train_precision", None) or "") for a in adapters]
    floors = [f for f in (scn.tol_floor, *floors) if f is not None]
    if not floors:
        return scn
    return dataclasses.replace(scn, tol_floor=Tolerance(max(f.rtol for f in floors),
                                                        max(f.atol for f in floors)))


def engine_parity(scn: Scenario, ctx: CheckContext, first, other) -> CheckResult:
    """``other``'s runs against ``first``'s, variant by variant, each narrowed to the metric
    names both log and the per-token tensors both return."""
    a, b = ctx.runs.get(first.name), ctx.runs.get(other.name)
    if not a or not b:
        idle = [t for t, runs in ((first, a), (other, b)) if not runs]
        why = "; ".join(f"{t.name} ran no variant ({_why_idle(t)})" for t in idle)
        return CheckResult(ENGINE_PARITY, other.name, NA, why)
    names = metric_universe(a, first.adapter) & metric_universe(b, other.adapter)
    masks = {v.name: v.batch.mask for v in ctx.variants}
    common = [v for v in b if v in a]
    failures, details, drift = [], {}, 0.0
    for v in common:
        keep = set(a[v].tokens) & set(b[v].tokens)
        got, want = (_narrowed(r[v], names, keep, params=bool(a[v].params and b[v].params))
                     for r in (b, a))
        c = compare_runs(scn, got, want, mask=masks[v], label=f"variant {v}")
        drift = max(drift, c.drift)
        failures += c.failures
        details.setdefault("failures", []).extend(c.details.get("failures", []))
    never = sorted({n for runs in (a, b) for r in runs.values() for s in r.steps for n in s}
                   - names)
    note = f" [not compared, logged by one engine only: {', '.join(never[:4])}]" if never else ""
    details["not_compared"] = never
    if not common:
        return CheckResult(ENGINE_PARITY, other.name, NA, f"{first.name} and {other.name} ran "
                           f"no variant in common")
    if failures:
        more = f" (+{len(failures) - 1} more)" if len(failures) > 1 else ""
        return CheckResult(ENGINE_PARITY, other.name, FAIL, f"against {first.name}: "
                           f"{failures[0]}{more}{note}", details, drift)
    return CheckResult(ENGINE_PARITY, other.name, PASS, f"{len(common)} variant(s) agree with "
                       f"{first.name} (worst relative drift {drift:.2g}){note}", details, drift)


def _narrowed(run, names: set[str], tokens: set[str], *, params: bool):
    return dataclasses.replace(run, tokens={k: x for k, x in run.tokens.items() if k in tokens},
                               steps=[{k: x for k, x in s.items() if k in names}
                                      for s in run.steps],
                               params=run.params if params else [])


def _why_idle(target) -> str:
    reasons = list(dict.fromkeys(target.skipped.values()))
    return reasons[0] if reasons else "nothing returned"


__all__ = ["ENGINE_PARITY", "at_precision", "checked_invariants", "engine_checks", "engine_parity",
           "engines_of", "own_checks"]
