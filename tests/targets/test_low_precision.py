"""A correct trainer computing in bfloat16 is green, and still caught when broken.

The toy trainer with its model loaded in bfloat16 (``precision = "bfloat16"``, which implies the
same train precision) through `run_target`, the code path of `rlaudit run --target`: stage
checks plus the built-in scenario. Before the checks knew about coarse precisions it failed
policy_loss:clip-effect (a 0.02 move demanded above a 0.02 tolerance), grad-norm-identity and
ppo-epochs-identity (SGD deltas of bf16 weights), kl-loss-direction (a 0.2 fall demanded above a
0.34 tolerance, on the reference too) and rollout-parity (bf16 log-probs ~0.2 from the sampler's).
"""

from __future__ import annotations

import pytest
import torch

from examples.toy_trainer import adapter as toy_adapter
from examples.toy_trainer import trainer as toy
from rlaudit.scenarios.result import ERROR, FAIL, NA, PASS
from rlaudit.targets.runner import run_target

pytestmark = pytest.mark.slow


class BF16Toy(toy_adapter.ToyAdapter):
    name = "toy-bf16"
    precision = "bfloat16"

    def _trainer(self, model_path, ref_model_path, batch, config, device):
        model = toy_adapter.load_model(model_path, "bfloat16").to(device)
        ref = None
        if config.actor.use_kl_loss or config.algorithm.use_kl_in_reward:
            ref = toy_adapter.load_model(ref_model_path or model_path, "bfloat16").to(device)
        trainer = self.trainer_class(model, toy_adapter.toy_config(config, len(batch)), ref)
        data = {k: v.to(device) if isinstance(v, torch.Tensor) else v
                for k, v in toy_adapter.to_toy(batch).items()}
        return model, trainer, data


class _KLLossAdded(toy.ToyTrainer):
    def with_kl_penalty(self, loss, kl):
        return loss - self.cfg.kl_loss_coef * kl        # pushes the policy away from the reference


class BF16ToyKLSign(BF16Toy):
    name = "toy-bf16-kl-sign"
    trainer_class = _KLLossAdded


def _checks(adapter):
    results = run_target(adapter, stages=["policy_loss"])
    return {(r.scenario, c.invariant): c for r in results for c in r.checks
            if c.backend in (adapter.name, "*")}


def test_a_bf16_trainer_is_green_with_the_unresolvable_checks_said():
    checks = _checks(BF16Toy())
    bad = {k: c.message[:300] for k, c in checks.items() if c.status in (FAIL, ERROR)}
    assert not bad, bad
    by_name = {inv: c for (_, inv), c in checks.items()}
    assert by_name["policy_loss:clip-effect"].status == PASS      # resolvable moves still judged
    assert by_name["rollout-parity"].status == PASS
    assert by_name["backend-parity"].status == PASS
    for name in ("grad-norm-identity", "ppo-epochs-identity"):
        assert by_name[name].status == NA and "16-bit" in by_name[name].message
    assert by_name["kl-loss-direction"].status == NA
    assert "not resolvable" in by_name["kl-loss-direction"].message


def test_a_broken_bf16_trainer_is_still_caught():
    checks = _checks(BF16ToyKLSign())
    failed = {inv for (_, inv), c in checks.items() if c.status == FAIL}
    assert {"config-effect", "backend-parity"} <= failed, failed
