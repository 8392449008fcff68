"""Rollout importance weights on a real train/rollout mismatch (issue #12 item 5): the stale-
snapshot scenario replayed on the toy trainer; a sequence-level weight computed at the wrong level
(token ratios, or the mean instead of the sum of log-ratios) is caught by rollout-correction and by
backend-parity, and the correct toy passes both."""

from __future__ import annotations

import pytest

import broken_adapters as broken
from examples.toy_trainer.adapter import ToyAdapter
from rlaudit.data.io import load_rollout
from rlaudit.verdict.result import FAIL, PASS
from rlaudit.scenarios.spec import load_scenario
from rlaudit.targets.run.runner import run_target_scenario

from conftest import REPO

pytestmark = pytest.mark.slow

INVARIANTS = ["rollout-correction", "backend-parity", "on-policy-identities"]


@pytest.fixture(scope="module")
def stale():
    scn = load_scenario(REPO / "scenarios" / "rollout_is_stale.yaml")
    return scn, load_rollout(scn.rollout)


def _mine(adapter, stale):
    scn, batch = stale
    res = run_target_scenario(adapter, scn, batch, invariants=INVARIANTS)
    ref = {c.invariant: c.status for c in res.checks if c.backend == "reference"}
    assert FAIL not in ref.values()
    return {c.invariant: c for c in res.checks if c.backend == adapter.name}


def test_correct_toy_passes(stale):
    mine = _mine(ToyAdapter(), stale)
    assert {k: c.status for k, c in mine.items()} == {k: PASS for k in INVARIANTS}, [
        c.message for c in mine.values()]
    assert "sequence: mean w 0.78, 12% outside" in mine["rollout-correction"].message


@pytest.mark.parametrize("cls", [broken.SequenceISFromMean, broken.SequenceISPerToken],
                         ids=lambda c: c.name)
def test_wrong_sequence_level_is_caught(cls, stale):
    mine = _mine(cls(), stale)
    assert mine["rollout-correction"].status == FAIL, mine["rollout-correction"].message
    assert "is:sequence" in mine["rollout-correction"].message
    assert mine["backend-parity"].status == FAIL, mine["backend-parity"].message
    # its own weights are self-consistent: the closed-form identity cannot tell
    assert mine["on-policy-identities"].status == PASS, mine["on-policy-identities"].message
