"""``rlaudit fuzz --target X``: every stage check driven by Hypothesis, failures shrunk and written
as replayable cases.

    report = fuzz_target("examples.toy_trainer.adapter:ToyAdapter", budget=50)
    report.findings          # [] on a correct trainer

For each stage the adapter provides and each of its checks, Hypothesis draws inputs and a
configuration (:mod:`rlaudit.targets.fuzz.strategies`: batch geometry, log-ratio regimes, the
estimator / KL kind / loss mode / aggregation / clip setting / DP size and token budget) and runs
the check on them through the same :class:`~rlaudit.targets.stages.registry.StageEnv` and
:class:`~rlaudit.targets.stages.registry.Tally` the fixed checks use, so the adapter's declared
precision, tolerances, conventions, differences and capabilities apply unchanged (a ``differs``
result is not a finding). A ``fail`` (or a check that raised) is shrunk by Hypothesis to a minimal
input and written under ``found_dir`` (:mod:`rlaudit.targets.run.found`); ``rlaudit run --target X
<found_dir>/<name>.yaml`` replays it. ``budget`` is Hypothesis' ``max_examples`` per check; examples
Hypothesis saved as failing before (its database, under the report directory) are replayed first.
``train_step`` is fuzzed at run level by :mod:`rlaudit.targets.fuzz.train_step`.
"""

from __future__ import annotations

import hashlib
import time
from pathlib import Path

from hypothesis import HealthCheck, Phase, Verbosity, given, seed, settings
from hypothesis.database import DirectoryBasedExampleDatabase

from rlaudit.errors import InputError, raise_problems
from rlaudit.scenarios.validate import HEADER
from rlaudit.targets.contract.adapter import STAGES, adapter_name, has_stage
from rlaudit.targets.contract.declare import Declarations, read_declarations
from rlaudit.targets.contract.load import load_adapter
from rlaudit.targets.fuzz.findings import CheckOutcome, Finding, FuzzReport, found_name
from rlaudit.targets.fuzz.strategies import stage_draws
from rlaudit.targets.fuzz.train_step import fuzz_train_step
from rlaudit.targets.inputs.cases import Draw
from rlaudit.targets.run.found import probe_env, save_stage_case, stage_results
from rlaudit.targets.run.validate import adapter_problems
from rlaudit.targets.stages.registry import StageCheck
from rlaudit.targets.stages.suite import stage_checks
from rlaudit.verdict.result import ERROR, FAIL, CheckResult

#: Hypothesis examples per stage check (``--budget``): enough to find every stage-level broken
#: adapter of tests/targets/broken_adapters.py (tests/targets/test_fuzz.py measures it)
DEFAULT_BUDGET = 60
#: bump when the strategies change shape, so stale database entries are not replayed
STRATEGY_VERSION = 1


class _Failed(Exception):
    """A probe's check failed (raised so that Hypothesis shrinks the example)."""


def probe(adapter: object, decl: Declarations, check: StageCheck, draw: Draw) -> CheckResult:
    """``check`` on ``draw`` (a no-mutation check after its stage's other checks, whose calls
    it reads). A check raising is reported as ERROR (a finding)."""
    env = probe_env(adapter, draw, decl)
    try:
        if check.name.endswith(":no-mutation"):
            return next(r for r in stage_results(env, check.stage) if r.invariant == check.name)
        return check.fn(env)
    except InputError:
        raise
    except Exception as e:  # a check (or the adapter outside attempt()) raised
        return CheckResult(check.name, env.name, ERROR,
                           f"the check raised {type(e).__name__}: {e}")


def fuzz_check(adapter: object, decl: Declarations, check: StageCheck, *, budget: int,
               database, rng_seed: int = 0) -> tuple[CheckOutcome, tuple | None]:
    """Hypothesis over one check: ``(outcome, (draw, result, examples) or None)``."""
    name = adapter_name(adapter)
    precision = decl.stage_precision.get(check.stage, decl.precision)
    strategy = stage_draws(check.stage, adapter, precision, check.name)
    if strategy is None:
        return CheckOutcome(check.name, "n/a", note="not fuzzed"), None
    state = {"n": 0, "first": None, "last": None}

    def body(draw):
        state["n"] += 1
        res = probe(adapter, decl, check, draw)
        if res.status in (FAIL, ERROR):
            state["first"] = state["first"] or state["n"]
            state["last"] = (draw, res)
            raise _Failed(res.message)

    test = settings(max_examples=budget, database=database, deadline=None,
                    report_multiple_bugs=False, verbosity=Verbosity.quiet,
                    suppress_health_check=list(HealthCheck),
                    phases=(Phase.explicit, Phase.reuse, Phase.generate, Phase.shrink))(
        seed(rng_seed)(given(strategy)(body)))
    key = f"rlaudit-fuzz:{STRATEGY_VERSION}:{name}:{check.name}".encode()
    test._hypothesis_internal_database_key = hashlib.sha256(key).digest()
    t0 = time.perf_counter()
    try:
        test()
    except _Failed:
        pass
    seconds = time.perf_counter() - t0
    if state["last"] is None:
        return CheckOutcome(check.name, "clean", state["n"], seconds), None
    draw, res = state["last"]
    return (CheckOutcome(check.name, "found", state["first"], seconds),
            (draw, res, state["first"]))


def fuzz_target(target: str | object, *, stages: list[str] | None = None,
                checks: list[str] | None = None, budget: int = DEFAULT_BUDGET,
                found_dir: str | Path = "scenarios/found", report_dir: str | Path = "reports",
                rng_seed: int = 0, write: bool = True, run_budget: int | None = None,
                scenarios_dir: str | Path = "scenarios",
                max_run_findings: int | None = None) -> FuzzReport:
    """Fuzz every stage check of ``target`` (``"module:Attr"`` or an adapter), restricted to
    ``stages`` (and to the check names ``checks``); ``train_step`` (when provided and selected)
    at run level with ``run_budget`` examples (:mod:`rlaudit.targets.fuzz.train_step`; it goes
    on after a finding, up to ``max_run_findings`` distinct ones, default all within the
    budget). Findings are written under ``found_dir`` (``write=False``: not written)."""
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
        raise InputError(f"expected an integer >= 1, got {budget!r}", key="--budget")
    spec = target if isinstance(target, str) else f"{type(target).__module__}:" \
                                                  f"{type(target).__qualname__}"
    adapter = load_adapter(target) if isinstance(target, str) else target
    decl = read_declarations(adapter)
    name = adapter_name(adapter)
    # a stage that cannot be called as the contract calls it is bad input, not a finding
    raise_problems(adapter_problems(adapter, spec), header=HEADER)
    unknown = sorted(set(stages or ()) - set(STAGES))
    if unknown:
        raise InputError(f"unknown stage(s) {unknown}; valid: {', '.join(STAGES)}",
                         key="--stage")
    db = DirectoryBasedExampleDatabase(str(Path(report_dir) / "fuzz" / "hypothesis"))
    report = FuzzReport(name, budget)
    t0 = time.perf_counter()
    ordered = sorted(stage_checks().values(), key=lambda c: list(STAGES).index(c.stage))
    for check in ordered:
        if stages is not None and check.stage not in stages:
            continue
        if check.stage == "train_step" or (checks is not None and check.name not in checks):
            continue
        if not has_stage(adapter, check.stage):
            report.outcomes.append(CheckOutcome(check.name, "n/a",
                                                note=f"{name} does not provide {check.stage}"))
            continue
        outcome, hit = fuzz_check(adapter, decl, check, budget=budget, database=db,
                                  rng_seed=rng_seed)
        report.outcomes.append(outcome)
        if hit is not None:
            draw, res, examples = hit
            path = None
            if write:
                path = save_stage_case(
                    found_dir, found_name(name, check.name), target=spec, check=check.name,
                    draw=draw, message=res.message,
                    found_by={"command": "rlaudit fuzz", "budget": budget, "seed": rng_seed,
                              "examples_until_found": examples, "shrunk": draw.describe()})
            report.findings.append(Finding(check.name, res.message, draw, path, examples,
                                           outcome.seconds))
    if has_stage(adapter, "train_step") and (stages is None or "train_step" in stages) and (
            checks is None or "train_step:run-level" in checks):
        fuzz_train_step(adapter, report, spec=spec, budget=run_budget, found_dir=found_dir,
                        database=db, rng_seed=rng_seed, write=write,
                        scenarios_dir=scenarios_dir, max_findings=max_run_findings)
    report.seconds = time.perf_counter() - t0
    return report
