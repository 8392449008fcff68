"""``rlaudit run --target module:Adapter``: every applicable check against someone else's trainer.

    results = run_target("examples.toy_trainer.adapter:ToyAdapter")
    results = run_target(MyAdapter(), scenario_names=["seed_entropy_coeff_zero"])

1. Stage checks (once, on generated inputs): the pseudo-scenario ``"stages"``.
2. When the adapter has ``train_step``: for each named scenario (or ``--all``; with neither, the
   built-in scenario of :mod:`rlaudit.targets.builtin`), the scenario's variants are replayed on
   the adapter and on the reference backend, and each of the scenario's invariants is checked,
   the adapter as one backend and the reference as the oracle. The scenario's own backend list
   is ignored: the target is the backend under audit.

An invariant that needs a variant the adapter does not support, or data its ``train_step`` did not
return, is n/a for the adapter (with the reason) and still runs for the reference. Parity compares
each variant on its own mask, the per-token tensors the adapter returned and the metric names it
logs in any variant (plus its declared ``metric_names``): a name it logs in one variant and drops
in another fails, one it never logs is listed as not compared.
"""

from __future__ import annotations

import dataclasses
import time
import traceback
from pathlib import Path

from rlaudit.backends.base import ReplayRequest
from rlaudit.backends.registry import get_backend
from rlaudit.config import flatten, to_dict
from rlaudit.errors import CheckFailed, InputError
from rlaudit.heap import freeze_long_lived
from rlaudit.metrics import golden_names
from rlaudit.scenarios.engine import build_variants, check_sampling_matches
from rlaudit.scenarios.invariants import INVARIANTS, CheckContext
from rlaudit.scenarios.invariants.parity import ORACLE
from rlaudit.scenarios.invariants.compare import (NEAR_MISS, compare_runs, moved_onto,
                                                  near_misses, widest)
from rlaudit.scenarios.invariants.metamorphic import cut_invariant_metrics
from rlaudit.scenarios.invariants.base import with_overrides
from rlaudit.scenarios.result import (DIFFERS, ERROR, FAIL, NA, PASS, CheckResult,
                                      ScenarioResult)
from rlaudit.scenarios.spec import Scenario
from rlaudit.targets import builtin
from rlaudit.targets.adapter import adapter_name, has_stage, load_adapter
from rlaudit.targets.backend_adapter import AdapterBackend, missing
from rlaudit.targets.checks import run_stage_checks
from rlaudit.targets.declare import Declarations, validate

#: invariants that compare the target with the reference run by run
PARITY_INVARIANTS = ("backend-parity", "dp-invariance")


def run_target(target: str | object, scenario_names: list[str] | None = None,
               all_: bool = False, scenarios_dir: str | Path = "scenarios", *,
               stages: list[str] | None = None,
               invariants: list[str] | None = None) -> list[ScenarioResult]:
    """Stage checks, then run-level invariants per scenario (see the module docstring).

    ``target``: ``"module:Attr"`` or an adapter object. ``stages`` / ``invariants`` restrict what
    runs (tests and quick iterations); ``invariants`` applies to every scenario.
    """
    adapter = load_adapter(target) if isinstance(target, str) else target
    name = adapter_name(adapter)
    if name == ORACLE:
        raise InputError(f"the name {ORACLE!r} is reserved for rlaudit's reference backend; "
                         f"give the adapter another name", source=type(adapter).__name__,
                         key="name")
    model = builtin.tiny_model_path(scenarios_dir)
    results = [run_stage_checks(adapter, stages=stages, model_path=str(model))]
    # stage cases found by `rlaudit fuzz` (scenarios/found/*.yaml, kind: stage-case) replay
    # their stage's checks on their input; scenario files run as scenarios
    from rlaudit.targets.found import is_stage_case, replay
    found = [n for n in scenario_names or [] if is_stage_case(n)]
    scenario_names = [n for n in scenario_names or [] if n not in found]
    results += [replay(adapter, p) for p in found]
    if found and not (scenario_names or all_):
        return results
    plans = []
    if all_ or not scenario_names:
        # the built-in scenario (every invariant) first: --all is the default run and every
        # shipped scenario (a blind audit, 2026-11-27: --all had left it out, and with it the
        # only scenario that runs padding-microbatches-complete on a target's own padding path)
        ref = builtin.tiny_model_path(scenarios_dir, "llama")
        plans.append((builtin.scenario(model, invariants, ref_model_path=ref),
                      lambda: (builtin.rollout(model), None)))
    if scenario_names or all_:
        from rlaudit.data.io import load_rollout
        from rlaudit.scenarios.spec import load_scenario, resolve
        scenarios = [load_scenario(p) for p in resolve(scenario_names or [], all_=all_,
                                                       root=scenarios_dir)]
        # the same rows the scenario engine replays (DAPO group filter applied when enabled),
        # and the unfiltered ones for targets that filter in their own train_step
        plans += [(s, lambda s=s: _filtered(load_rollout(s.rollout), s)) for s in scenarios]
    for scn, rollout in plans:
        if not has_stage(adapter, "train_step"):
            results.append(ScenarioResult(
                scenario=scn.name, path=str(scn.path), backends=[name],
                checks=[CheckResult("*", name, NA, f"{name} does not provide train_step: no "
                                    f"run-level invariant applies")]))
            continue
        batch, raw = rollout()
        results.append(run_target_scenario(adapter, scn, batch, invariants=invariants,
                                           unfiltered=raw))
    return results


def _filtered(raw, scn: Scenario):
    from rlaudit.update.step import select_groups
    return select_groups(raw, scn.config)[0], raw


def run_target_scenario(adapter: object, scn: Scenario, batch, *,
                        invariants: list[str] | None = None,
                        unfiltered=None) -> ScenarioResult:
    """One scenario: replay its variants on the adapter and the reference backend, then check
    its invariants (or ``invariants``). ``batch``: the rows replayed (after DAPO's group filter
    when the scenario enables it); ``unfiltered``: the rollout before the filter, handed (with
    each variant's rows) to an adapter declaring ``filters_groups``."""
    t0 = time.perf_counter()
    target = AdapterBackend(adapter)
    name = target.name
    scn = declared_scenario(scn, validate(adapter))
    scn = dataclasses.replace(
        scn, backends={name: dict(getattr(adapter, "layout", {}) or {}), ORACLE: {}},
        invariants=list(invariants or scn.invariants))
    check_sampling_matches(scn, batch)
    variants = build_variants(scn, batch)
    decl = validate(adapter)
    if (decl.filters_groups and unfiltered is not None
            and scn.config.algorithm.filter_groups.enable):
        from rlaudit.targets.dynamic_sampling import unfiltered_inputs
        target.inputs, skipped = unfiltered_inputs(variants, unfiltered)
        target.skipped.update(skipped)
    res = ScenarioResult(scenario=scn.name, path=str(scn.path), backends=[name, ORACLE],
                         config=flatten(to_dict(scn.config)), layouts=dict(scn.backends),
                         dtype=scn.dtype, device=scn.device, tags=[*scn.tags, "target"],
                         provenance=_provenance(scn, batch, name))
    ok, why = target.available()
    if not ok:      # nothing to compare: do not spend time on the reference either
        res.checks.append(CheckResult("*", name, NA, f"target unavailable: {why}"))
        res.seconds = time.perf_counter() - t0
        return res
    runs = {}
    freeze_long_lived()   # trainers collect garbage themselves: keep it off the imports
    for b, backend in ((name, target), (ORACLE, get_backend(ORACLE))):
        request = ReplayRequest(model=str(scn.model), variants=variants,
                                ref_model=str(scn.ref_model) if scn.ref_model else None,
                                layout=scn.backends[b], dtype=scn.dtype, device=scn.device)
        try:
            runs[b] = backend.replay(request)
            if "base" in runs[b]:
                res.metrics[b] = runs[b]["base"].steps
        except InputError:
            raise
        except CheckFailed as e:  # a finding said by rlaudit itself: its message says it all
            res.errors[b] = f"{type(e).__name__}: {e}"
        except (Exception, SystemExit) as e:  # a crashing trainer is a finding, with its traceback
            res.errors[b] = f"{type(e).__name__}: {e}\n{traceback.format_exc()}"
    for b, err in res.errors.items():
        res.checks.append(CheckResult("*", b, ERROR, err.splitlines()[0], {"traceback": err}))
    ctx = CheckContext(scenario=scn, batch=batch, runs=runs, errors=res.errors,
                       variants=variants)

    def checks() -> list[CheckResult]:
        return [r for inv in scn.invariants for r in apply_differences(
            check_invariant(inv, ctx, name, adapter, target.skipped), name, decl)]

    found = checks()
    if decl.noise() and ORACLE in runs:
        found = with_noise_floor(found, checks, lambda draw: attach_noise_floor(
            runs, scn, variants, decl.noise(), draw=draw))
    res.checks.extend(found)
    res.runs = runs
    if not res.passed:  # only a failure is localised: nothing extra runs otherwise
        from rlaudit.targets.localise import localise_target
        res.localisation = localise_target(adapter, name, scn, ctx, res)
    res.seconds = time.perf_counter() - t0
    return res


def declared_scenario(scn: Scenario, decl: Declarations) -> Scenario:
    """``scn`` as run against a target with declarations ``decl``: tolerances at least the
    target's train precision's (its explicit run-level overrides win), and the reference set to
    compute as the target declares (its conventions and metric reduction become config values
    of every variant, for the reference replay too)."""
    config = scn.config
    overrides = decl.config_overrides()
    if overrides:
        config = with_overrides(config, **overrides)
    return dataclasses.replace(scn, config=config, tol_floor=decl.run_floor(),
                               tol_overrides={**scn.tol_overrides, **decl.run_overrides()})


#: check statuses the noise floor cannot change: it is measured only when a check ends otherwise
CLEAN = (PASS, NA)


#: draws of the perturbed replay at most (each one more replay of every variant)
NOISE_DRAWS = 3


def with_noise_floor(found: list[CheckResult], checks, measure) -> list[CheckResult]:
    """The check results once the noise floor has decided what it can: ``found`` are the checks
    without a floor, ``checks()`` runs them again, ``measure(draw)`` attaches draw ``draw`` of the
    floor (:func:`attach_noise_floor`).

    The floor only ever widens a bound, so checks that all pass without it pass with it: it is
    measured only when one does not. It is measured again, with the next draw (up to
    NOISE_DRAWS), only when every comparison it decided failed narrowly -- by at most NEAR_MISS
    times its bound (one draw's spread can fall short where clipping amplifies rounding); a
    failure by more, or by an unbounded ratio, is a finding and costs no further draw."""
    draw = 0
    while draw < NOISE_DRAWS and any(r.status not in CLEAN for r in found):
        measure(draw)
        draw += 1
        with near_misses() as missed:
            found = checks()
        if not 0.0 < missed["worst"] <= NEAR_MISS:
            break
    return found


def attach_noise_floor(runs: dict, scn: Scenario, variants, noise: float, *,
                       draw: int = 0) -> None:
    """Replay every variant on the reference with its weights perturbed by ``noise`` (the unit
    roundoff of the target's precision) and attach each result as ``run.noise`` to the runs of
    that variant on every backend: comparisons then allow a multiple of the spread rounding
    causes in this scenario (rlaudit.scenarios.invariants.compare.NOISE_FACTOR).

    The floor is slack added to a bound, never taken from one: a metric's ``atol + rtol * |want|``
    gains ``NOISE_FACTOR * spread``, a per-token tensor's elementwise bound likewise, and the
    parameters, compared elementwise without a floor, are compared per tensor in L2 with one
    (``||got - want|| <= atol * sqrt(n) + rtol * ||want|| + floor``, which every elementwise pass
    meets by the triangle inequality). A check that passes without the floor therefore passes
    with it, and :func:`run_target_scenario` replays the noise only when some check does not
    pass without it (about a third of a correct target's run-level time saved).

    ``draw`` > 0: another fixed draw of the same noise, merged with those before
    (:func:`~rlaudit.scenarios.invariants.compare.widest`): one draw's spread can fall short of
    a correct target's by more than NOISE_FACTOR where clipping amplifies rounding, and
    :func:`run_target_scenario` asks for the next draw when every floored comparison missed
    by at most NEAR_MISS times its bound."""
    request = ReplayRequest(model=str(scn.model), variants=variants,
                            ref_model=str(scn.ref_model) if scn.ref_model else None,
                            layout={}, dtype=scn.dtype, device=scn.device, weight_noise=noise,
                            noise_draw=draw)
    noisy = get_backend(ORACLE).replay(request)
    oracle = runs.get(ORACLE, {})
    for backend, backend_runs in runs.items():
        for name, run in backend_runs.items():
            if name not in noisy:
                continue
            # another backend's run gets the reference's spread around its own values: a
            # comparison of two of its runs then allows rounding, not its distance from the
            # reference (compare.moved_onto)
            fresh = (moved_onto(noisy[name], oracle[name], run)
                     if backend != ORACLE and name in oracle else noisy[name])
            run.noise = (fresh if run.noise is None or draw == 0
                         else widest(run, run.noise, fresh))


def apply_differences(results: list[CheckResult], target: str, decl: Declarations
                      ) -> list[CheckResult]:
    """A failing result of ``target`` whose every problem is a declared difference (without a
    convention) becomes ``differs``; any undeclared problem keeps it a failure."""
    out = []
    for r in results:
        if r.status != FAIL or r.backend != target or not decl.differences:
            out.append(r)
            continue
        problems = [f["message"] for f in r.details.get("failures", [])
                    if isinstance(f, dict) and f.get("message")] or [r.message]
        found = {}
        for p in problems:
            d = decl.declared(r.invariant, p)
            if d is None:
                found = None
                break
            found.setdefault(d.name, (d, []))[1].append(p)
        if not found:
            out.append(r)
            continue
        details = {**r.details, "differences": {
            n: {"declared": d.describe(), "count": len(ps), "problems": ps[:10]}
            for n, (d, ps) in found.items()}}
        msg = "as declared: " + "; ".join(f"{n} ({len(ps)} problem(s), e.g. {ps[0]})"
                                          for n, (_, ps) in found.items())
        out.append(dataclasses.replace(r, status=DIFFERS, message=msg, details=details))
    return out


def check_invariant(inv_name: str, ctx: CheckContext, target: str, adapter: object,
                    skipped: dict[str, str]) -> list[CheckResult]:
    """One invariant: n/a for the target when it lacks a variant or data (the reference is still
    checked); parity invariants compare the target with the reference (:func:`target_parity`)."""
    inv = INVARIANTS.get(inv_name)
    out: list[CheckResult] = []
    runs = ctx.runs.get(target)
    sub = ctx
    if runs is not None:
        universe = metric_universe(runs, adapter)
        needed = [v.name for v in inv.variants(ctx.scenario, ctx.batch)] or ["base"]
        absent = [v for v in needed if v not in runs]
        present = [v for v in needed if v in runs]
        if inv.partial and absent and needed[0] in runs and len(present) >= 2:
            # alternatives to a baseline (needed[0]): check the variants the target ran; the
            # invariant names the others n/a in its message
            needed, absent = present, []
        configs = {v.name: v.config for v in ctx.variants}
        why = ("variant(s) not run by the target: " + "; ".join(
            f"{v} ({skipped.get(v, 'not returned')})" for v in absent[:2])
               if absent else missing(inv_name, {v: runs[v] for v in needed}, configs, universe))
        if why:
            out.append(CheckResult(inv_name, target, NA, why))
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
    tensors and parameters the target returned; metrics named in ``universe``."""
    out = {}
    for v, run in ref_runs.items():
        t = target_runs.get(v)
        keep = set(t.tokens) if t is not None else set()
        out[v] = dataclasses.replace(
            run, tokens={k: x for k, x in run.tokens.items() if k in keep},
            steps=[{k: x for k, x in s.items() if k in universe} for s in run.steps],
            params=run.params if t is not None and t.params else [])
    return out


def _provenance(scn: Scenario, batch, target: str) -> dict:
    from rlaudit.data.io import rollout_sha256
    from rlaudit.model.load import snapshot_id
    return {"target": target, "model_sha": snapshot_id(scn.model),
            "rollout_sha": rollout_sha256(batch)}


__all__ = ["run_target", "run_target_scenario", "check_invariant"]
