"""What an invocation makes of its scenarios: a failure inside one scenario is that scenario's
result (the others still run, and everything finished is reported), and one exit code for all.

    res = run_isolated(scn, golden_dir="golden")     # never raises for the scenario's own problem
    code = exit_code(results, require_golden=True)

Exit codes (rlaudit.errors): 2 when any scenario met bad input (found late, while it ran: the
validation pass catches what it can before anything runs), else 1 when any scenario failed (an
invariant, a golden mismatch or a stale golden, a crashed backend, a refused bless) or was blessed,
or -- with ``require_golden`` -- has no golden to compare against, else 0. A scenario where
nothing applied ("n/a") is neither: counted apart, and a run where nothing applied anywhere exits 1
(it verified nothing).
"""

from __future__ import annotations

import time
import traceback

from rlaudit.errors import EXIT_BAD_INPUT, EXIT_CHECK_FAILED, EXIT_OK, InputError
from rlaudit.scenarios import engine
from rlaudit.verdict.result import (BAD_INPUT, ERROR, NO_GOLDEN_STATE, NOTHING_APPLIED, PASSED,
                                    CheckResult, ScenarioResult)

#: the pseudo-invariant under which a scenario's own failure is tabled
SCENARIO_CHECK = "scenario"


def run_isolated(scn, **kwargs) -> ScenarioResult:
    """:func:`rlaudit.scenarios.engine.run_scenario`, with anything it raises turned into this
    scenario's result: an InputError gives state "bad input" (file and key in the message), any
    other exception an error row with its traceback. KeyboardInterrupt still propagates."""
    t0 = time.perf_counter()
    try:
        return engine.run_scenario(scn, **kwargs)  # read at call time: a wrapper may replace it
    except InputError as e:
        res = _empty_result(scn, kwargs.get("backends"))
        res.input_error = str(e)
        res.checks.append(CheckResult(SCENARIO_CHECK, "*", ERROR, f"bad input: {e}"))
    except Exception as e:  # noqa: BLE001 - one scenario's crash must not lose the others
        res = _empty_result(scn, kwargs.get("backends"))
        tb = traceback.format_exc()
        res.checks.append(CheckResult(SCENARIO_CHECK, "*", ERROR,
                                      f"the scenario crashed: {type(e).__name__}: {e}",
                                      {"traceback": tb}))
    res.seconds = time.perf_counter() - t0
    return res


def _empty_result(scn, backends: list[str] | None) -> ScenarioResult:
    names = [b for b in (backends or list(scn.backends)) if b in scn.backends or b == "reference"]
    return ScenarioResult(scenario=scn.name, path=str(scn.path), backends=names,
                          layouts={b: dict(scn.backends.get(b, {})) for b in names},
                          dtype=scn.dtype, device=scn.device, tags=list(scn.tags))


def exit_code(results: list[ScenarioResult], *, require_golden: bool = False) -> int:
    """The invocation's exit code (see the module docstring); no results is a failure."""
    states = {r.state for r in results}
    if BAD_INPUT in states:
        return EXIT_BAD_INPUT
    ok = {PASSED, NOTHING_APPLIED} | (set() if require_golden else {NO_GOLDEN_STATE})
    # a run where nothing applied anywhere verified nothing: never a green
    return EXIT_OK if states <= ok and states - {NOTHING_APPLIED} else EXIT_CHECK_FAILED
