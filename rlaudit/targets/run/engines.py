"""Several engines of one target, each its own column: a trainer with more than one training
backend (verl's FSDP and Megatron engines) names them in ``engines``, a tuple of adapters, each
with its own ``name`` (the column), ``train_step`` / ``replay``, ``supports`` and
``metric_names``; the declarations (differences, conventions, tolerances, metric reduction) stay
the target's, so one reference replay serves every column.

Every invariant runs per engine with the reference as the oracle, as for a one-engine target;
then ``engine-parity`` compares each further engine with the first on every variant both ran
(the backend-parity comparison, over the metric names both log and the per-token tensors both
return): backend parity inside the target. An adapter without ``engines`` is its own only
engine, and its results are what they were.
"""

from __future__ import annotations

import dataclasses

from rlaudit.scenarios.invariants import CheckContext
from rlaudit.scenarios.invariants.parity import ORACLE
from rlaudit.scenarios.spec import Scenario
from rlaudit.targets.contract.declare import Declarations
from rlaudit.targets.run.parity import apply_differences, check_invariant, metric_universe
from rlaudit.verdict.compare import compare_runs
from rlaudit.verdict.result import FAIL, NA, PASS, CheckResult

#: the check comparing two engines of one target (reported in the later engine's column)
ENGINE_PARITY = "engine-parity"


def engines_of(adapter: object) -> tuple:
    """The adapter's ``engines`` (each a column), or the adapter itself."""
    engines = tuple(getattr(adapter, "engines", None) or ())
    return engines or (adapter,)


def engine_checks(scn: Scenario, ctx: CheckContext, targets: list, decl: Declarations
                  ) -> list[CheckResult]:
    """Every invariant of ``scn`` per engine (``targets``: TargetBackends; the reference's own
    results once, with the first), declared differences applied, then engine-parity."""
    out: list[CheckResult] = []
    for i, t in enumerate(targets):
        sub = ctx if len(targets) == 1 else dataclasses.replace(
            ctx, runs={b: r for b, r in ctx.runs.items() if b in (t.name, ORACLE)})
        for inv in scn.invariants:
            found = apply_differences(check_invariant(inv, sub, t.name, t.adapter, t.skipped,
                                                      t.unsupported), t.name, decl)
            out += [r for r in found if i == 0 or r.backend == t.name]
    out += [engine_parity(scn, ctx, targets[0], t) for t in targets[1:]]
    return out


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


__all__ = ["ENGINE_PARITY", "engine_checks", "engine_parity", "engines_of"]
