"""The run-level noise floor (rlaudit/targets/run/noise.py) is measured only when a check does not
pass without it, and the checks come out exactly as if it had always been measured.

The floor is the reference replayed with its weights perturbed at the target's unit roundoff
(one more replay of every variant); it only ever adds slack to a bound. Each case below runs
the built-in scenario twice, once as shipped and once with the floor always measured
(``noise.CLEAN`` emptied: no status counts as clean), and compares every check.
"""

from __future__ import annotations

import pytest

import broken_adapters as broken
from examples.toy_trainer.adapter import ToyAdapter
from rlaudit.verdict.result import FAIL, PASS
from rlaudit.targets.inputs import builtin
from rlaudit.targets.run import noise, runner
from test_low_precision import BF16Toy

pytestmark = pytest.mark.slow

INVARIANTS = ["backend-parity", "microbatch-invariance", "rollout-parity"]


def _run(adapter, tiny_model, rollout, monkeypatch, *, always: bool):
    calls = []
    real = runner.attach_noise_floor

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    with monkeypatch.context() as m:
        m.setattr(runner, "attach_noise_floor", counted)
        if always:
            m.setattr(noise, "CLEAN", ())
        scn = builtin.scenario(tiny_model, INVARIANTS,
                               ref_model_path=builtin.tiny_model_path(None, "llama"))
        res = runner.run_target_scenario(adapter, scn, rollout, invariants=INVARIANTS)
    checks = [(c.invariant, c.backend, c.status, c.message, c.drift) for c in res.checks]
    return checks, len(calls)


@pytest.mark.parametrize("adapter, fails", [
    (ToyAdapter(), False),                    # float64 trainer, hf-float64 floor: all pass
    (BF16Toy(), False),                       # bf16: passes only with the floor
    (broken.PerMicroMeanTrainer(), True),     # caught with or without it
], ids=["toy", "toy-bf16", "per-micro-mean"])
def test_checks_are_those_of_always_measuring_the_floor(adapter, fails, tiny_model,
                                                        builtin_rollout, monkeypatch):
    lazy, lazy_calls = _run(adapter, tiny_model, builtin_rollout, monkeypatch, always=False)
    eager, eager_calls = _run(adapter, tiny_model, builtin_rollout, monkeypatch, always=True)
    assert eager_calls == 1
    assert lazy == eager
    statuses = {s for _, b, s, _, _ in lazy if b == adapter.name}
    assert (FAIL in statuses) == fails
    if adapter.name == "toy":     # nothing to widen: the floor was never replayed
        assert lazy_calls == 0 and statuses == {PASS}
    else:
        assert lazy_calls == 1


def test_the_bf16_trainer_needs_the_floor(tiny_model, builtin_rollout, monkeypatch):
    """Without the floor (never measured) the correct bf16 trainer fails: the case above is one
    where the floor decides, not one that would pass anyway."""
    monkeypatch.setattr(runner, "attach_noise_floor", lambda *a, **k: None)
    checks, _ = _run(BF16Toy(), tiny_model, builtin_rollout, monkeypatch, always=False)
    assert any(b == "toy-bf16" and s == FAIL for _, b, s, _, _ in checks), checks


def test_a_metamorphic_relation_gets_the_spread_of_rounding_not_of_the_bug(
        tiny_model, builtin_rollout, monkeypatch):
    """A trainer clipping each micro-batch's accumulated gradient (a seventh blind audit's bug
    #1) runs 1 row per micro-batch and all rows per micro-batch to different results (grad norm
    13.7 vs 8.4 at step 0). microbatch-invariance compares the trainer with itself, so its floor
    is the reference's perturbed spread laid onto the trainer's own values
    (compare.moved_onto): the bug fails it, as it fails backend-parity -- two checks. With the
    perturbed reference taken as it is, the floor was the trainer's distance from the reference
    (the bug itself, 0.63 relative, allowed ten times) and microbatch-invariance passed."""
    invariants = ["microbatch-invariance", "row-permutation"]
    scn = builtin.scenario(tiny_model, invariants,
                           ref_model_path=builtin.tiny_model_path(None, "llama"))
    res = runner.run_target_scenario(broken.ClipsEachMicroBatch(), scn, builtin_rollout,
                                     invariants=invariants)
    mine = {c.invariant: c for c in res.checks if c.backend == "clips-each-micro-batch"}
    assert mine["microbatch-invariance"].status == FAIL, mine["microbatch-invariance"].message
    # the correct bf16 trainer stays green on the same relations (rounding, not a bug)
    res = runner.run_target_scenario(BF16Toy(), scn, builtin_rollout, invariants=invariants)
    assert {c.status for c in res.checks if c.backend == "toy-bf16"} == {PASS}, \
        [c.message for c in res.checks if c.backend == "toy-bf16"]
