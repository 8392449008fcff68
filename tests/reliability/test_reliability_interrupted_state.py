"""An interrupted scenario is never counted passed: state "interrupted" whatever it holds, in
the console table and summary, the JSON, the HTML and Markdown report and the exit code
(hand-built results; the real Ctrl-C is test_reliability_stop.py)."""

from __future__ import annotations

from rlaudit.report.console import render_result, render_summary
from rlaudit.report.run_report import render_html, render_markdown
from rlaudit.scenarios.outcome import exit_code
from rlaudit.verdict.result import (GOLDEN_PASS, PASS, CheckResult, GoldenResult,
                                    ScenarioResult)


def result(name: str, *, interrupted: bool = False) -> ScenarioResult:
    """Every check passed and the golden matched: a pass, unless interrupted."""
    return ScenarioResult(scenario=name, path=f"{name}.yaml", backends=["reference"],
                          checks=[CheckResult("sanity-bounds", "reference", PASS)],
                          golden=[GoldenResult("reference", GOLDEN_PASS)],
                          interrupted=interrupted)


def test_an_interrupted_scenario_is_never_passed_whatever_it_holds():
    done, stopped = result("done"), result("stopped", interrupted=True)
    assert (done.state, done.passed) == ("passed", True)
    assert (stopped.state, stopped.passed) == ("interrupted", False)


def test_the_console_table_and_summary_say_interrupted():
    results = [result("done"), result("stopped", interrupted=True)]
    assert render_result(results[1]).startswith("stopped: INTERRUPTED")
    summary = render_summary(results)
    assert summary.splitlines()[0] == "1/2 scenarios passed (1 interrupted)"
    assert "  INTERRUPTED stopped" in summary.splitlines()


def test_the_json_says_interrupted_and_a_finished_result_is_unchanged():
    stopped = result("stopped", interrupted=True).to_json()
    assert (stopped["state"], stopped["passed"], stopped["interrupted"]) == (
        "interrupted", False, True)
    assert "interrupted" not in result("done").to_json()


def test_the_reports_say_interrupted():
    results = [result("done"), result("stopped", interrupted=True)]
    md = render_markdown(results, {})
    assert "**1/2 scenarios passed**" in md
    assert "## stopped: INTERRUPTED" in md
    assert "| stopped | **INTERRUPTED** |" in md.replace("  ", " ")
    html = render_html(results, {})
    assert '<td class="err">interrupted</td>' in html          # the summary table's cell
    assert html.count('<span class="badge err">INTERRUPTED</span>') == 2  # summary, scenario


def test_an_interrupted_scenario_fails_the_exit_code():
    assert exit_code([result("done")]) == 0
    assert exit_code([result("done"), result("stopped", interrupted=True)]) != 0
