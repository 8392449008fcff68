"""A scenario where nothing applied is never a green: its own state ("n/a"), counted apart in the
summary, and a run where nothing applied anywhere does not exit 0.

Results are built by hand (statuses chosen per case), so each expectation is read off the
definition, not off the code under test.
"""

from __future__ import annotations

from rlaudit.errors import EXIT_CHECK_FAILED, EXIT_OK
from rlaudit.report.console import render_summary
from rlaudit.report.mlflow_log import invocation_passed
from rlaudit.scenarios.outcome import exit_code
from rlaudit.verdict.result import (FAIL, NA, PASS, CheckResult, GoldenResult, ScenarioResult)


def _result(name: str, *statuses: str, golden: tuple[str, ...] = ()) -> ScenarioResult:
    res = ScenarioResult(scenario=name, path=f"{name}.yaml", backends=["trainer"])
    res.checks = [CheckResult(f"inv{i}", "trainer", s) for i, s in enumerate(statuses)]
    res.golden = [GoldenResult("reference", g) for g in golden]
    return res


def test_every_check_na_and_no_golden_is_nothing_applied():
    r = _result("seed", NA, NA, NA)
    assert r.state == "n/a" and not r.passed
    assert _result("empty").state == "n/a"            # no check at all: nothing applied either


def test_one_check_that_applied_or_a_golden_compared_is_a_pass():
    assert _result("one", NA, PASS, NA).state == "passed"
    assert _result("golden", NA, NA, golden=("pass",)).state == "passed"
    assert _result("no-golden", NA, golden=("no golden",)).state == "no golden"
    assert _result("failed", NA, FAIL).state == "failed"


def test_exit_code_counts_na_apart_and_refuses_a_run_that_checked_nothing():
    ok, na, bad = _result("a", PASS), _result("b", NA), _result("c", FAIL)
    assert exit_code([ok, na]) == EXIT_OK
    assert exit_code([na, na]) == EXIT_CHECK_FAILED
    assert exit_code([na, bad]) == EXIT_CHECK_FAILED
    assert exit_code([]) == EXIT_CHECK_FAILED


def test_mlflow_passed_agrees_with_the_exit_code():
    ok, na = _result("a", PASS), _result("b", NA)
    assert invocation_passed([ok, na]) is True
    assert invocation_passed([na]) is False
    assert invocation_passed([ok, na], interrupted=["c"]) is False


def test_summary_counts_na_apart_and_says_when_nothing_was_checked():
    text = render_summary([_result("a", PASS), _result("b", NA), _result("c", NA)])
    assert text.splitlines()[0] == "1/3 scenarios passed (2 n/a)"
    assert "  N/A b" in text and "nothing was checked" not in text
    assert "nothing was checked" in render_summary([_result("b", NA)])
