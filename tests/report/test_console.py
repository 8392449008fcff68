"""The plain-text table: a backend on which no check applied says so and why, instead of a
scenario reading PASSED with nothing behind it for that backend."""

from __future__ import annotations

from rlaudit.report.console import render_result
from rlaudit.verdict.result import NA, PASS, CheckResult, ScenarioResult


def _result(toy_statuses):
    checks = [CheckResult("backend-parity", "reference", NA, "only the reference backend ran")]
    checks += [CheckResult(inv, "toy", st, msg) for inv, st, msg in toy_statuses]
    return ScenarioResult(scenario="s", path="s.yaml", backends=["reference", "toy"],
                          checks=checks)


def test_a_backend_with_only_na_checks_is_named_with_the_reasons():
    text = render_result(_result([
        ("backend-parity", NA, "variant(s) not run by the target: base (adv_estimator drgrpo)"),
        ("sanity-bounds", NA, "variant(s) not run by the target: base (adv_estimator drgrpo)"),
        ("rollout-parity", NA, "rollout has no rollout_log_probs")]))
    assert ("  n/a [toy]: no check applied to this backend: variant(s) not run by the target: "
            "base (adv_estimator drgrpo); rollout has no rollout_log_probs") in text
    assert "n/a [reference]" in text          # the reference column had only n/a here too


def test_a_backend_with_a_passing_check_gets_no_such_line():
    text = render_result(_result([("backend-parity", PASS, "agree"),
                                  ("rollout-parity", NA, "rollout has no rollout_log_probs")]))
    assert "n/a [toy]" not in text


def test_an_error_prints_its_traceback_once_and_a_one_line_finding_only_once():
    from rlaudit.verdict.result import ERROR
    one = "CheckFailed: toy.train_step: its DAPO group filter ... kept 24 of the 32 rows"
    multi = "RankFailure: rank 1 died\nTraceback (most recent call last):\n  boom"
    res = ScenarioResult(scenario="s", path="s.yaml", backends=["toy", "fsdp"],
                         checks=[CheckResult("*", "toy", ERROR, one),
                                 CheckResult("*", "fsdp", ERROR, multi.splitlines()[0])],
                         errors={"toy": one, "fsdp": multi})
    text = render_result(res)
    assert text.count("kept 24 of the 32 rows") == 1        # the ERROR line says all of it
    assert "backend toy crashed" not in text
    assert "backend fsdp crashed:" in text and "    boom" in text   # the traceback, once
