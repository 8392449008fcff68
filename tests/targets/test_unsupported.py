"""A release that lacks what a check needs is ``unsupported`` (feature and release named), never a
failed invariant and never a pass, and it hides none of the checks that do apply.

The adapters are hand-built: rlaudit's reference stages with one stage saying, as an adapter
over an old release would, that the release lacks a feature (``UnsupportedFeature``), or with one
stage raising a plain ``TypeError`` inside its math (a bug: still a failure).
"""

from __future__ import annotations

import pytest

import broken_adapters as broken
from examples.toy_trainer.adapter import ToyAdapter
from rlaudit.errors import EXIT_CHECK_FAILED, EXIT_OK
from rlaudit.report.console import render_result, render_summary
from rlaudit.report.mlflow_content import child_tags
from rlaudit.report.mlflow_log import invocation_passed
from rlaudit.scenarios.outcome import exit_code
from rlaudit.targets import UnsupportedFeature
from rlaudit.targets.contract.own_adapters import ReferenceAdapter
from rlaudit.targets.inputs import builtin
from rlaudit.targets.run.runner import run_target_scenario
from rlaudit.targets.stages import run_stage_checks
from rlaudit.verdict.result import (FAIL, NA, PASS, UNSUPPORTED, CheckResult, ScenarioResult)

RELEASE = "trainer 0.5.0"


class NoGlobalCounts(ReferenceAdapter):
    """agg_loss as a release before global counts existed: local counts only."""

    name = "no-global-counts"

    def agg_loss(self, *, loss_mat, mask, mode, denominators=None):
        if denominators is not None:
            raise UnsupportedFeature("agg_loss with global token/sequence counts",
                                     release=RELEASE, reason="added in 0.7")
        return super().agg_loss(loss_mat=loss_mat, mask=mask, mode=mode)


class NoGlobalCountsAndABug(NoGlobalCounts):
    """As above, and compute_advantages groups rows by position (a real bug elsewhere)."""

    name = "no-global-counts-and-a-bug"

    def compute_advantages(self, **kw):
        return broken.GroupsByPosition().compute_advantages(**kw)


class TypeErrorInTheMath(ReferenceAdapter):
    """agg_loss whose own arithmetic raises TypeError: a bug, not a missing feature."""

    name = "type-error-in-math"

    def agg_loss(self, *, loss_mat, mask, mode, denominators=None):
        return loss_mat.sum() / None        # the trainer's arithmetic fails


class NoGSPO(ReferenceAdapter):
    """policy_loss as a release whose registry has no ``gspo``."""

    name = "no-gspo"

    def policy_loss(self, *, loss_mode, **kw):
        if loss_mode == "gspo":
            raise UnsupportedFeature("policy loss 'gspo' in its registry", release=RELEASE)
        return super().policy_loss(loss_mode=loss_mode, **kw)


def _by_check(res: ScenarioResult) -> dict[str, CheckResult]:
    return {c.invariant: c for c in res.checks}


def test_a_missing_feature_is_unsupported_with_the_release_and_reason():
    res = run_stage_checks(NoGlobalCounts(), stages=["agg_loss"])
    got = _by_check(res)
    split = got["agg_loss:global-split"]
    assert split.status == UNSUPPORTED, split.message
    assert RELEASE in split.message and "added in 0.7" in split.message
    lacked = next(iter(split.details["unsupported"].values()))
    assert lacked["release"] == RELEASE and "global token/sequence counts" in lacked["feature"]
    # the check that applies (local counts) still runs and passes
    assert got["agg_loss:parity"].status == PASS
    assert res.state == "passed" and [c.invariant for c in res.unsupported] == [
        "agg_loss:global-split"]


def test_an_exception_inside_the_math_stays_a_failure():
    got = _by_check(run_stage_checks(TypeErrorInTheMath(), stages=["agg_loss"]))
    assert got["agg_loss:parity"].status == FAIL
    assert "TypeError" in got["agg_loss:parity"].message


def test_unsupported_never_hides_a_real_finding():
    res = run_stage_checks(NoGlobalCountsAndABug(), stages=["agg_loss", "compute_advantages"])
    got = _by_check(res)
    assert got["agg_loss:global-split"].status == UNSUPPORTED
    assert got["compute_advantages:parity"].status == FAIL
    assert res.state == "failed"


def test_one_unsupported_name_leaves_the_others_checked():
    got = _by_check(run_stage_checks(NoGSPO(), stages=["policy_loss"]))
    parity = got["policy_loss:parity"]
    assert parity.status == PASS, parity.message        # vanilla, cispo, ... compared
    assert "gspo" in parity.details["unsupported"]
    assert RELEASE in parity.details["skipped"]["gspo"]


def _scenario(*statuses: str) -> ScenarioResult:
    res = ScenarioResult(scenario="s", path="s.yaml", backends=["t"])
    res.checks = [CheckResult(f"inv{i}", "t", s, f"{s} {RELEASE}") for i, s in
                  enumerate(statuses)]
    return res


def test_state_exit_code_and_mlflow_count_unsupported_apart():
    ok = _scenario(PASS, UNSUPPORTED)
    only = _scenario(UNSUPPORTED, NA)
    assert ok.state == "passed" and only.state == "n/a"
    assert _scenario(FAIL, UNSUPPORTED).state == "failed"
    assert exit_code([ok]) == EXIT_OK
    assert exit_code([only]) == EXIT_CHECK_FAILED       # nothing was verified: never a green
    assert invocation_passed([ok]) and not invocation_passed([only])
    tags = child_tags(ok, "t", "p", None, {})
    assert tags["rlaudit.unsupported"] == "1" and tags["invariant.inv1"] == UNSUPPORTED
    assert RELEASE in tags["invariant.inv1.message"]
    assert ok.to_json()["unsupported"] == 1


def test_console_shows_unsupported_apart_from_failures():
    text = render_result(_scenario(PASS, UNSUPPORTED))
    assert "unsupported inv1 [t] (not a failure)" in text and "FAIL" not in text
    summary = render_summary([_scenario(UNSUPPORTED, NA)])
    assert "1 check(s) unsupported by the release under audit" in summary
    assert "nothing was checked: every check of every scenario was n/a or unsupported" in summary


@pytest.mark.slow
def test_a_train_step_the_release_cannot_run_is_unsupported(tiny_model, builtin_rollout):
    class NoKLInReward(ToyAdapter):
        name = "toy-no-kl-in-reward"

        def train_step(self, *, config, **kw):
            if config.algorithm.use_kl_in_reward:
                raise UnsupportedFeature("KL in the reward", release=RELEASE)
            return super().train_step(config=config, **kw)

    invariants = ["stored-kl-unaltered", "backend-parity"]
    scn = builtin.scenario(tiny_model, invariants,
                           ref_model_path=builtin.tiny_model_path(None, "llama"))
    res = run_target_scenario(NoKLInReward(), scn, builtin_rollout, invariants=invariants)
    mine = {c.invariant: c for c in res.checks if c.backend == "toy-no-kl-in-reward"}
    assert mine["stored-kl-unaltered"].status == UNSUPPORTED, mine["stored-kl-unaltered"]
    assert RELEASE in mine["stored-kl-unaltered"].message
    assert mine["backend-parity"].status == PASS, mine["backend-parity"].message
    assert not res.errors and res.state == "passed"
