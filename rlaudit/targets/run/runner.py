"""``rlaudit run --target module:Adapter``: every applicable check against someone else's trainer.

    results = run_target("examples.toy_trainer.adapter:ToyAdapter")
    results = run_target(MyAdapter(), scenario_names=["seed_entropy_coeff_zero"])

1. Stage checks (once, on generated inputs): the pseudo-scenario ``"stages"``.
2. When the adapter has ``train_step``: for each named scenario (or ``--all``; with neither, the
   built-in scenario of :mod:`rlaudit.targets.inputs.builtin`), the scenario's variants are
   replayed on the adapter and on the reference backend, and each of the scenario's invariants
   is checked, the adapter as one backend and the reference as the oracle. The scenario's own
   backend list is ignored: the target is the backend under audit.

An invariant that needs a variant the adapter does not support, or data its ``train_step`` did not
return, is n/a for the adapter (with the reason) and still runs for the reference. Parity compares
each variant on its own mask, the per-token tensors the adapter returned and the metric names it
logs in any variant (plus its declared ``metric_names``): a name it logs in one variant and drops
in another fails, one it never logs is listed as not compared.
"""

from __future__ import annotations

import dataclasses
import traceback
from pathlib import Path

from rlaudit.backends.base import ReplayRequest
from rlaudit.backends.registry import get_backend
from rlaudit.data.io import rollout_sha256
from rlaudit.errors import CheckFailed, InputError
from rlaudit.heap import freeze_long_lived
from rlaudit.model.load import snapshot_id
from rlaudit.scenarios import localise
from rlaudit.scenarios.engine import ScenarioPolicy, run_scenario, scenario_rows
from rlaudit.scenarios.invariants import CheckContext
from rlaudit.scenarios.invariants.base import with_overrides
from rlaudit.scenarios.invariants.parity import ORACLE
from rlaudit.scenarios.spec import Scenario, load_scenario, resolve
from rlaudit.scenarios.variants import build_variants
from rlaudit.targets.contract.adapter import adapter_name, has_stage
from rlaudit.targets.contract.declare import Declarations, read_declarations
from rlaudit.targets.contract.load import load_adapter
from rlaudit.targets.inputs import builtin
from rlaudit.targets.inputs.dynamic_sampling import unfiltered_inputs
from rlaudit.targets.run.engines import ENGINE_PARITY, checked_invariants, engine_checks, engines_of
from rlaudit.targets.run.found import is_stage_case, replay
from rlaudit.targets.run.localise import localise_target
from rlaudit.targets.run.noise import attach_noise_floor, with_noise_floor
from rlaudit.targets.run.parity import check_invariant
from rlaudit.targets.run.target_backend import TargetBackend
from rlaudit.targets.run.upstream import first_difference
from rlaudit.targets.stages.suite import run_stage_checks
from rlaudit.verdict.result import NA, CheckResult, ScenarioResult
from rlaudit.verdict.unsupported import UnsupportedFeature


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
    found = [n for n in scenario_names or [] if is_stage_case(n)]
    scenario_names = [n for n in scenario_names or [] if n not in found]
    results += [replay(adapter, p) for p in found]
    if found and not (scenario_names or all_):
        return results
    plans = []
    if all_ or not scenario_names:
        # the built-in scenario (every invariant) first: --all is the default run and every
        # shipped scenario; leaving it out of --all silently drops the only scenario that runs
        # padding-microbatches-complete on a target's own padding path (a coverage gap)
        ref = builtin.tiny_model_path(scenarios_dir, "llama")
        plans.append((builtin.scenario(model, invariants, ref_model_path=ref),
                      lambda: (builtin.rollout(model), None)))
    if scenario_names or all_:
        scenarios = [load_scenario(p) for p in resolve(scenario_names or [], all_=all_,
                                                       root=scenarios_dir)]
        # the same rows the scenario engine replays (DAPO group filter applied when enabled),
        # and the unfiltered ones for targets that filter in their own train_step
        plans += [(s, lambda s=s: scenario_rows(s)) for s in scenarios]
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


def run_target_scenario(adapter: object, scn: Scenario, batch, *,
                        invariants: list[str] | None = None,
                        unfiltered=None) -> ScenarioResult:
    """One scenario: replay its variants on the adapter and the reference backend, then check
    its invariants (or ``invariants``). ``batch``: the rows replayed (after DAPO's group filter
    when the scenario enables it); ``unfiltered``: the rollout before the filter, handed (with
    each variant's rows) to an adapter declaring ``filters_groups``."""
    return run_scenario(scn, policy=TargetPolicy(adapter, batch, invariants=invariants,
                                                 unfiltered=unfiltered))


class TargetPolicy(ScenarioPolicy):
    """The scenario engine's steps against a target: the adapter is the backend under audit and
    the reference the oracle (the scenario's own backend list is ignored), tolerances and
    conventions as the target declares (:func:`declared_scenario`), every variant built (one the
    adapter does not support is n/a for it), declared differences and the noise floor applied to
    the checks, no goldens."""

    tags = ("target",)

    def __init__(self, adapter: object, batch, *, invariants: list[str] | None = None,
                 unfiltered=None):
        super().__init__(timeout=ReplayRequest.timeout)
        self.adapter, self.batch, self.invariants = adapter, batch, invariants
        self.unfiltered = unfiltered
        #: one column per engine the adapter names (``engines``, see engines_of), else its own
        self.targets = [TargetBackend(e) for e in engines_of(adapter)]
        self.target, self.name = self.targets[0], self.targets[0].name
        self.decl: Declarations | None = None

    def prepare(self, scn: Scenario) -> Scenario:
        self.decl = read_declarations(self.adapter)
        scn = declared_scenario(scn, self.decl)
        return dataclasses.replace(
            scn, backends={**{t.name: dict(getattr(t.adapter, "layout", {}) or {})
                              for t in self.targets}, ORACLE: {}},
            invariants=list(self.invariants or scn.invariants))

    def rows(self, scn: Scenario):
        return self.batch

    def plan(self, scn: Scenario) -> tuple[list[str], list[str]]:
        return [t.name for t in self.targets] + [ORACLE], []

    def variants(self, scn: Scenario, batch) -> list:
        variants = build_variants(scn, batch)
        if (self.decl.filters_groups and self.unfiltered is not None
                and scn.config.algorithm.filter_groups.enable):
            inputs, skipped = unfiltered_inputs(variants, self.unfiltered)
            for t in self.targets:
                t.inputs = inputs
                t.skipped.update(skipped)
        return variants

    def provenance(self, scn: Scenario, batch) -> dict:
        return {"target": self.name, "model_sha": snapshot_id(scn.model),
                "rollout_sha": rollout_sha256(batch)}

    def jobs(self, scn, names, variants, res) -> list | None:
        ok, why = self.target.available()
        if not ok:      # nothing to compare: do not spend time on the reference either
            res.checks.append(CheckResult("*", self.name, NA, f"target unavailable: {why}"))
            return None
        freeze_long_lived()   # trainers collect garbage themselves: keep it off the imports
        # an engine column checked by named invariants only (engines.own_checks) runs when
        # the scenario checks one of them: otherwise it would train for no check
        return [(b, backend, localise.replay_request(scn, variants, b, self.timeout))
                for b, backend in ([(t.name, t) for t in self.targets
                                    if checked_invariants(scn, t.adapter)]
                                   + [(ORACLE, get_backend(ORACLE))])]

    def replay_all(self, jobs: list) -> list:
        done = []
        for b, backend, request in jobs:
            try:
                done.append((b, backend.replay(request)))
            except InputError:
                raise
            except UnsupportedFeature as e:  # the adapter: this release runs none of them
                for v in request.variants:
                    backend.skipped[v.name], backend.unsupported[v.name] = str(e), e
                done.append((b, {}))
            except CheckFailed as e:  # a finding said by rlaudit itself: its message says it all
                done.append((b, f"{type(e).__name__}: {e}"))
            except (Exception, SystemExit) as e:  # a crashing trainer: a finding, with traceback
                done.append((b, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
        return done

    def checks(self, scn: Scenario, ctx: CheckContext) -> list[CheckResult]:
        def checks() -> list[CheckResult]:
            return engine_checks(scn, ctx, self.targets, self.decl)

        found = checks()
        noise = self.decl.noise()
        if noise and ORACLE in ctx.runs:
            found = with_noise_floor(found, checks, lambda draw: attach_noise_floor(
                ctx.runs, scn, ctx.variants, noise, draw=draw))
        # after the noise floor: a filter keeping other rows is no rounding (no floor for it)
        return found + first_difference(ctx, self.name, self.target.diverged)

    def localise(self, scn: Scenario, ctx: CheckContext, res: ScenarioResult):
        if len(self.targets) == 1:
            return localise_target(self.adapter, self.name, scn, ctx, res)
        # per engine, against the reference (engine-parity names both engines in its message)
        return [e for t in self.targets for e in localise_target(
            t.adapter, t.name, scn, ctx, dataclasses.replace(res, checks=[
                c for c in res.checks if c.backend == t.name and c.invariant != ENGINE_PARITY]))]


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


__all__ = ["run_target", "run_target_scenario", "check_invariant"]
