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
from rlaudit.verdict.result import ERROR, FAIL, NA, PASS
from rlaudit.targets.stages import run_stage_checks
from rlaudit.targets.contract.own_adapters import ReferenceAdapter
from rlaudit.targets.run.runner import run_target

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


# ---- stage level: rlaudit's own stage functions evaluated in bfloat16 ---------------------------

def _bf16(kw):
    return {k: v.to(torch.bfloat16) if isinstance(v, torch.Tensor) and v.is_floating_point()
            else v for k, v in kw.items()}


class BF16Stages(ReferenceAdapter):
    """The reference's advantages, KL and losses computed on bfloat16 inputs. Before: a group's
    GRPO advantages summing to 0.03 (rounding of the terms, judged against the sum's size 0),
    a clip fraction off by one token and a gradient 0 vs 0.11 at a token whose ratio sits on a
    clip bound within bf16 rounding, each failed a correct computation."""
    name = "reference-bf16"
    precision = "bfloat16"

    def compute_advantages(self, **kw):
        return super().compute_advantages(**_bf16(kw))

    def kl_penalty(self, **kw):
        return super().kl_penalty(**_bf16(kw))

    def agg_loss(self, **kw):
        return super().agg_loss(**_bf16(kw))

    def policy_loss(self, **kw):
        return super().policy_loss(**_bf16(kw))


class BF16RatioInverted(BF16Stages):
    name = "reference-bf16-ratio-inverted"

    def policy_loss(self, **kw):
        kw["old_log_prob"], kw["log_prob"] = kw["log_prob"], kw["old_log_prob"]
        return super().policy_loss(**kw)


def _stage_statuses(adapter):
    res = run_stage_checks(adapter, stages=["compute_advantages", "kl_penalty", "agg_loss",
                                            "policy_loss"])
    return {c.invariant: c for c in res.checks}


def test_stage_functions_in_bf16_pass_at_their_declared_precision():
    checks = _stage_statuses(BF16Stages())
    bad = {k: c.message[:300] for k, c in checks.items() if c.status in (FAIL, ERROR)}
    assert not bad, bad
    assert checks["policy_loss:parity"].status == PASS
    assert checks["compute_advantages:identities"].status == PASS


def test_an_inverted_ratio_in_bf16_is_still_caught():
    checks = _stage_statuses(BF16RatioInverted())
    failed = {k for k, c in checks.items() if c.status == FAIL}
    assert {"policy_loss:parity", "policy_loss:clip-effect"} <= failed, failed
