"""Backend parity (family 6) and DP-size invariance: every backend, on the same weights and
rollout, agrees with the reference backend on every variant the scenario ran — per-token log-probs
and entropy, losses, grad norm, updated parameters, and the set of metric names."""

from __future__ import annotations

from rlaudit.scenarios.invariants.base import CheckContext, invariant, not_applicable, result
from rlaudit.verdict.compare import compare_runs
from rlaudit.scenarios.invariants.metamorphic import cut_invariant_metrics

ORACLE = "reference"


def _parity(ctx: CheckContext, name: str, backends: list[str], *, recut: bool = False):
    out = []
    oracle = ctx.runs.get(ORACLE)
    for b in ctx.backends():
        if b == ORACLE:
            continue
        if b not in backends:
            continue
        if oracle is None:
            out.append(not_applicable(name, b, "the reference backend did not run"))
            continue
        failures, drift, details = [], 0.0, {}
        common = [v for v in ctx.runs[b]
                  if ctx.run(b, v) is not None and ctx.run(ORACLE, v) is not None]
        for v in common:
            metrics = cut_invariant_metrics(ctx.scenario, oracle[v]) if recut else None
            c = compare_runs(ctx.scenario, ctx.runs[b][v], oracle[v], mask=ctx.mask(v),
                             metrics=metrics, label=f"variant {v}")
            drift = max(drift, c.drift)
            if not c.ok:
                failures.extend(c.failures)
                details.setdefault("failures", []).extend(c.details.get("failures", []))
        msg = (f"{failures[0]}" + (f" (+{len(failures) - 1} more)" if len(failures) > 1 else "")
               if failures else f"{len(common)} variant(s) agree with {ORACLE} "
                                f"(worst relative drift {drift:.2g})")
        out.append(result(name, b, not failures, msg, details, drift))
    if not out:
        others = [b for b in ctx.backends() if b != ORACLE]
        why = ("only the reference backend ran" if not others
               else f"no backend with this property among {others}")
        out.append(not_applicable(name, ORACLE, why))
    return out


@invariant("backend-parity", "parity")
def backend_parity(ctx: CheckContext):
    """For every backend other than the reference, and every variant both ran (the baseline and
    each invariant's re-cut/flag-flipped copies): metrics (the golden-compared ones) within
    tolerance, identical metric-name sets, per-token tensors (probe log-probs/entropy, old/ref
    log-probs, advantages, ...) on valid tokens, and updated parameters after every step."""
    return _parity(ctx, "backend-parity", ctx.backends())


@invariant("dp-invariance", "metamorphic")
def dp_invariance(ctx: CheckContext):
    """Results do not depend on the data-parallel size: each backend laid out with dp > 1 agrees
    with the one-rank reference on every variant (global token/sequence denominators, metrics
    reduced as one batch would be, padding micro-batches without effect)."""
    multi = [b for b in ctx.backends() if ctx.scenario.backends.get(b, {}).get("dp", 1) > 1]
    return _parity(ctx, "dp-invariance", multi, recut=True)
