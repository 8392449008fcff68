"""Several weighted reward functions at run level (scenario trl_reward_weights): the unmodified
toy trainer and the reference are green on reward-logging, a toy trainer that sums its reward
functions unweighted is red; the check's expectations are hand-worked from the rollout."""

from __future__ import annotations

import pytest
import torch

import broken_adapters as broken
from examples.toy_trainer.adapter import ToyAdapter
from rlaudit.data.io import load_rollout
from rlaudit.scenarios.invariants.reward_logging import naive_expected, several_functions_off
from rlaudit.scenarios.spec import load_scenario
from rlaudit.verdict.result import FAIL, PASS

from peers.peer_cli import REPO

SCENARIO = REPO / "scenarios" / "trl_reward_weights.yaml"


class _IgnoresRewardWeights(broken.toy.ToyTrainer):
    def step(self, data):
        # its own reward combination: every function's score summed, the weights forgotten
        per, scored = data["reward_scores"].double(), data["reward_mask"]
        return super().step({**data, "scores": torch.where(scored, per, 0.0).sum(1)})


IgnoresRewardWeights = broken.toy_with(_IgnoresRewardWeights, "ignores-reward-weights")


def test_expected_rewards_by_hand():
    """short-ref-rewards: task scores (in twelfths) 12 12 11 11 | 11 10 10 11 | 9 10 10 12 |
    11 7 12 11 -> mean 170/192; brevity (1 - len/12) on the 10 rows with task >= 0.9, lengths
    5 5 5 4 4 4 5 4 6 6 -> (7+7+7+8+8+8+7+8+6+6)/12/10 = 0.6; combined = task mean + 0.5 x the
    brevity sum over all 16 rows = 170/192 + 0.5 x 6/16."""
    want = naive_expected(load_rollout(REPO / "scenarios/rollouts/short-ref-rewards.safetensors"))
    assert want["critic/score/task/mean"] == pytest.approx(170 / 192, abs=1e-7)
    assert want["critic/score/brevity/mean"] == pytest.approx(0.6, abs=1e-7)
    assert want["critic/score/mean"] == pytest.approx(170 / 192 + 0.5 * 6 / 16, abs=1e-7)


def test_trigger_is_off_without_several_functions():
    assert several_functions_off(load_scenario(SCENARIO)) is None
    why = several_functions_off(load_scenario(REPO / "scenarios" / "trl_gradacc_uneven.yaml"))
    assert why and "several reward functions" in why


def _statuses(adapter):
    from rlaudit.targets.run.runner import run_target
    (res,) = run_target(adapter, scenario_names=["trl_reward_weights"], stages=[],
                        invariants=["reward-logging", "backend-parity"])[1:]
    return {(c.invariant, c.backend): c for c in res.checks}


@pytest.mark.slow
def test_toy_green_and_toy_ignoring_weights_red():
    ok = _statuses(ToyAdapter())
    assert ok[("reward-logging", "toy")].status == PASS, ok[("reward-logging", "toy")].message
    assert "no per-function means logged" in ok[("reward-logging", "toy")].message
    assert ok[("reward-logging", "reference")].status == PASS
    assert "critic/score/brevity/mean" in ok[("reward-logging", "reference")].message
    assert ok[("backend-parity", "toy")].status == PASS
    bad = _statuses(IgnoresRewardWeights())
    c = bad[("reward-logging", "ignores-reward-weights")]
    # unweighted: 170/192 + 6/16 = 1.2604 logged where the weights give 1.0729
    assert c.status == FAIL and "critic/score/mean = 1.2604" in c.message, c.message
    assert bad[("backend-parity", "ignores-reward-weights")].status == FAIL
