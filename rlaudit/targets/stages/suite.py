"""Running the stage checks: every registered check on the stages an adapter provides, as the
pseudo-scenario ``"stages"``.
"""

from __future__ import annotations

import time
import traceback

from rlaudit.errors import InputError
from rlaudit.targets.contract.adapter import STAGES, has_stage
from rlaudit.targets.stages.registry import STAGE_CHECKS, StageCheck, StageEnv
from rlaudit.verdict.result import ERROR, NA, CheckResult, ScenarioResult
from rlaudit.verdict.unsupported import UnsupportedFeature, unsupported_result


def stage_checks() -> dict[str, StageCheck]:
    """Every registered stage check, by name (importing this module runs the package face,
    which imports every family first)."""
    return STAGE_CHECKS


def run_stage_checks(adapter: object, *, stages: list[str] | None = None,
                     model_path: str | None = None) -> ScenarioResult:
    """Every registered check, on the stages the adapter provides (``stages`` restricts them),
    as the pseudo-scenario ``"stages"`` with the adapter as its only backend."""
    t0 = time.perf_counter()
    env = StageEnv(adapter, model_path=model_path)
    name = env.name
    res = ScenarioResult(scenario="stages", path="<stage checks>", backends=[name],
                         tags=["stages"])
    ordered = sorted(stage_checks().values(),
                     key=lambda c: (list(STAGES).index(c.stage), c.name.endswith("no-mutation")))
    for check in ordered:
        if stages is not None and check.stage not in stages:
            continue
        if not has_stage(adapter, check.stage):
            res.checks.append(CheckResult(check.name, name, NA,
                                          f"{name} does not provide {check.stage}"))
            continue
        try:
            res.checks.append(check.fn(env))
        except InputError:      # the adapter's declarations are wrong (exit 2), not a finding
            raise
        except UnsupportedFeature as e:  # said by the adapter outside attempt(): whole check
            res.checks.append(unsupported_result(check.name, name, {check.stage: e}))
        except (Exception, SystemExit) as e:  # a bug in the check, or the adapter outside attempt()
            res.checks.append(CheckResult(check.name, name, ERROR,
                                          f"the check raised {type(e).__name__}: {e}",
                                          {"traceback": traceback.format_exc()}))
    res.seconds = time.perf_counter() - t0
    return res
