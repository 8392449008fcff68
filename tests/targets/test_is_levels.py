"""rollout-correction applies per IS level a trainer supports: a trainer with token-level IS only
is checked on the ``is:token`` variant of the shipped IS scenarios (before: n/a there, as those
needed all three levels, and green on the built-in scenario whose weights are ~1), so an inverted
token ratio is red on a named scenario, and the correct token-only trainer is green with the other
levels named n/a."""

from __future__ import annotations

import pytest

import broken_adapters as broken
from rlaudit.data.io import load_rollout
from rlaudit.scenarios.spec import load_scenario
from rlaudit.targets.run.runner import run_target_scenario
from rlaudit.verdict.result import FAIL, PASS

from conftest import REPO

pytestmark = pytest.mark.slow

#: the shipped IS scenarios whose own level the token-only trainer declines
SCENARIOS = ["rollout_is_stale", "rollout_is_stale_mask"]


def _check(adapter, name):
    scn = load_scenario(REPO / "scenarios" / f"{name}.yaml")
    res = run_target_scenario(adapter, scn, load_rollout(scn.rollout),
                              invariants=["rollout-correction"])
    got = {c.backend: c for c in res.checks}
    assert got["reference"].status == PASS, got["reference"].message
    return got[adapter.name]


@pytest.mark.parametrize("name", SCENARIOS)
def test_token_only_trainer_checked_on_its_level(name):
    c = _check(broken.TokenISOnly(), name)
    assert c.status == PASS, c.message
    assert "token: mean w" in c.message
    assert "is:sequence" in c.message and "is:geometric" in c.message    # named n/a


@pytest.mark.parametrize("name", SCENARIOS)
def test_inverted_token_ratio_is_red(name):
    c = _check(broken.TokenISInverted(), name)
    assert c.status == FAIL, c.message
    assert "is:token" in c.message
