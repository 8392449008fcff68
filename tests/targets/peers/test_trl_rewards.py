"""TRL's GRPOTrainer with two weighted reward functions (scenario trl_reward_weights): the
adapter hands TRL one reward function per column of the rollout's ``reward_scores`` (None where
a function did not score a row) and the rollout's ``reward_weights``; TRL's own logged
``rewards/<func>/mean`` and ``reward`` then agree with the rollout (reward-logging) and its
training with the reference (backend-parity). A GRPOTrainer that drops the configured weights
is red on both. Skipped unless TRL is installed (make peers)."""

from __future__ import annotations

import importlib.util

import pytest

from rlaudit.errors import InputError
from rlaudit.targets.peers import activate, installed_versions

try:
    activate("trl", None)
    if importlib.util.find_spec("trl") is None:
        raise ImportError("No module named 'trl'")
except (InputError, ImportError) as e:  # pragma: no cover - depends on the machine
    pytest.skip(f"TRL is not installed ({installed_versions('trl')}): {e}",
                allow_module_level=True)

from rlaudit.targets.peers.trl import TRLAdapter  # noqa: E402
from rlaudit.targets.run.runner import run_target  # noqa: E402
from rlaudit.verdict.result import FAIL, PASS  # noqa: E402

pytestmark = pytest.mark.slow
SCENARIO = "trl_reward_weights"
CHECKS = ["reward-logging", "backend-parity"]


@pytest.fixture(autouse=True, scope="module")
def _trl_active():
    """TRL's directory first on the path again (see test_trl_knobs)."""
    activate("trl", None)


def _checks(adapter) -> dict:
    (res,) = run_target(adapter, scenario_names=[SCENARIO], stages=[], invariants=CHECKS)[1:]
    return {c.invariant: c for c in res.checks if c.backend == adapter.name}


def test_trl_logs_the_rollouts_rewards():
    got = _checks(TRLAdapter())
    msg = got["reward-logging"].message
    assert got["reward-logging"].status == PASS, msg
    # TRL logged all three: the per-function means (nanmean: brevity over its 10 rows) and the
    # combined reward
    for name in ("critic/score/mean", "critic/score/task/mean", "critic/score/brevity/mean"):
        assert name in msg
    assert got["backend-parity"].status == PASS, got["backend-parity"].message


def test_trl_ignoring_the_weights_is_red():
    from trl import GRPOTrainer
    import torch

    class EqualWeights(GRPOTrainer):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            self.reward_weights = torch.ones(len(self.reward_funcs))

    adapter = TRLAdapter()
    adapter.trainer_class = EqualWeights
    got = _checks(adapter)
    c = got["reward-logging"]
    # TRL's `reward` with weights 1, 1: 170/192 + 6/16 = 1.2604 where the rollout gives 1.0729;
    # the per-function means do not depend on the weights
    assert c.status == FAIL and "critic/score/mean = 1.260" in c.message, c.message
    assert "critic/score/task/mean =" not in c.message
    assert got["backend-parity"].status == FAIL
