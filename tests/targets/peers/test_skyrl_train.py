"""SkyRL 0.4.0's own update on CPU (rlaudit.targets.peers.skyrl_train) against rlaudit's reference
update on the built-in rollout (8 rows, two groups of 4, temperature 0.7, a row with an empty
response, holes in response_mask): two steps of GRPO, PPO-clip token-mean, two mini-batches of
two micro-batches, two epochs, SGD, no KL, float32 on both sides. The reference is an
independent implementation of the same step (rlaudit/update), so a wrong layout, shift,
temperature, loss scaling or micro-batch weighting on SkyRL's side moves log-probs, advantages,
metrics or parameters well past float32 noise.

What is not mapped is reported, never run (pure functions: no SkyRL needed), and so is the CPU
stand-in for SkyRL's CUDA calls (skyrl_cpu) restoring torch as it found it.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from rlaudit.config import load_config
from rlaudit.targets.contract.own_adapters import ReferenceAdapter
from rlaudit.targets.inputs import builtin
from rlaudit.targets.peers import peers_dir, skyrl_compat, skyrl_cpu
from rlaudit.targets.peers.skyrl_train import TRAINER_IMPORTS, rows_unsupported, unsupported

PINNED = "0.4.0"
#: float32 on both sides, different reduction orders
RTOL = 1e-4
#: parameters after eight SGD updates (2 steps x 2 epochs x 2 mini-batches, lr 0.5 on a gradient
#: clipped to norm 1): float32 noise measured at 2.7e-6, against entries that move by up to 0.065
PARAM_ATOL = 1e-5
#: the reference set to SkyRL's declared metric reduction (clip fraction and entropy: means of
#: micro-batch means; the loss: a contribution), as a `--target skyrl` run sets it
REDUCTION = {"metric_reduction": "microbatch-mean", "metric_reduction_except": ["actor/pg_loss"]}


def _config(dtype="float32", **actor):
    cfg = dict(builtin.CONFIG)
    cfg["actor"] = {**cfg["actor"], **actor}
    cfg["trainer"] = {**cfg["trainer"], "dtype": dtype, **REDUCTION}
    return load_config(cfg)


def test_unmapped_settings_are_named():
    assert unsupported(_config()) == []
    assert unsupported(_config(optim={"name": "adamw", "lr": 1e-3})) == []
    assert any("actor.optim.eps" in w
               for w in unsupported(_config(optim={"name": "adamw", "eps": 1e-9})))
    assert any("use_kl_loss" in w for w in unsupported(_config(use_kl_loss=True)))
    assert any("loss_mode" in w for w in unsupported(_config(loss_mode="gspo")))
    assert any("entropy_coeff" in w for w in unsupported(_config(entropy_coeff=0.01)))
    assert any("use_dynamic_bsz" in w for w in unsupported(_config(use_dynamic_bsz=True)))
    assert any("trainer.dtype" in w for w in unsupported(_config(dtype="bfloat16")))


def test_rows_skyrl_cannot_take_are_named():
    model = builtin.tiny_model_path()
    batch = builtin.rollout(model)
    assert rows_unsupported(_config(), batch) == ""
    # an empty response (row 4) with a score: SkyRL has no token to put it on
    scored = batch.with_fields(scores=torch.where(batch["response_lengths"] == 0, 1.0,
                                                   batch["scores"]))
    assert "empty response" in rows_unsupported(_config(), scored)
    # groups not in consecutive rows: SkyRL cuts mini-batches by prompt
    mixed = batch.with_fields(uid=torch.tensor([0, 1, 0, 1, 0, 1, 0, 1]))
    assert "consecutive groups" in rows_unsupported(_config(), mixed)
    assert "mini-batches of 3" in rows_unsupported(_config(ppo_mini_batch_size=3), batch)


def test_only_the_mapped_release_runs_train_step():
    assert skyrl_compat.train_step_unsupported("0.4.0") == ""
    for version, word in (("0.1.0", "right-pads"), ("0.2.0", "BatchIterator"),
                          ("0.3.0", "workers/worker.py:844")):
        why = skyrl_compat.train_step_unsupported(version)
        assert f"skyrl-{version}" in why and word in why


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU stand-in is off with a GPU")
def test_cuda_calls_answer_for_cpu_inside_the_block_only():
    real_current = torch.cuda.current_device
    with skyrl_cpu.cuda_as_cpu():
        assert torch.cuda.current_device() == "cpu"
        x = torch.ones(2)
        assert torch.ones(2).to(torch.cuda.current_device()).device.type == "cpu"
        assert x.cuda().device.type == "cpu"
        torch.cuda.synchronize()    # nothing to wait for
    assert torch.cuda.current_device is real_current
    with pytest.raises((AssertionError, RuntimeError)):
        torch.ones(1).cuda()


def _skyrl_ready():
    if not (peers_dir() / f"skyrl-{PINNED}" / "skyrl" / "__init__.py").is_file():
        pytest.skip(f"skyrl=={PINNED} is not installed under {peers_dir()} (run `make peers`)")
    root = peers_dir() / f"skyrl-{PINNED}"
    gone = [m for m in TRAINER_IMPORTS
            if not (root / m).is_dir() and importlib.util.find_spec(m) is None]
    if gone:
        pytest.skip(f"the SkyRL peer lacks {gone} (re-run `make peers`)")


@pytest.mark.slow
def test_skyrl_update_matches_reference_on_builtin_rollout():
    _skyrl_ready()
    from rlaudit.targets.peers.skyrl_train import output, train_steps  # lazy: slow path only
    model = builtin.tiny_model_path()
    batch = builtin.rollout(model)
    cfg = _config()
    (result,) = train_steps(model, [(batch, cfg, 2)], version=PINNED)
    got = output(result, batch)
    ref = ReferenceAdapter().train_step(model_path=model, batch=batch, config=cfg, steps=2)
    mask = batch["response_mask"].bool()
    torch.testing.assert_close(got.log_probs[mask], ref.log_probs.double()[mask], rtol=RTOL,
                               atol=1e-5)
    torch.testing.assert_close(got.tokens["advantages"][mask],
                               ref.tokens["advantages"].double()[mask], rtol=RTOL, atol=1e-6)
    for step in range(2):
        assert set(got.metrics[step]) == {"actor/pg_loss", "actor/pg_clipfrac",
                                          "actor/grad_norm", "actor/lr"}
        for name, value in got.metrics[step].items():
            assert value == pytest.approx(float(ref.metrics[step][name]), rel=RTOL, abs=1e-6), \
                (step, name)
        assert set(got.params[step]) == set(ref.params[step])
        for name, p in got.params[step].items():
            torch.testing.assert_close(p.double().flatten(),
                                       ref.params[step][name].double().flatten(), rtol=RTOL,
                                       atol=PARAM_ATOL, msg=name)
    # the entropy SkyRL logs is a token mean whatever the aggregation (not mapped): under the
    # token-mean of this config it is rlaudit's, which checks the forward's temperature too
    for step in range(2):
        assert result["metrics"][step]["policy/policy_entropy"] == pytest.approx(
            float(ref.metrics[step]["actor/entropy"]), rel=RTOL)
    # the step trained: the parameters moved (lr 0.5, clipped to norm 1) and the norm was logged
    assert got.metrics[0]["actor/grad_norm"] > 1.0
    name = "model.embed_tokens.weight"
    moved = (got.params[1][name].double() - got.params[0][name].double()).abs().max()
    assert moved > 100 * PARAM_ATOL


@pytest.mark.slow
def test_skyrl_adamw_matches_reference_on_builtin_rollout():
    """SkyRL's own AdamW (its strategy's; torch's eps 1e-8, the one mapped): the same step with
    weight decay 0.1 and betas (0.9, 0.95). Adam divides by the gradient's running RMS, so
    float32 noise on entries with a near-zero gradient moves them by up to the measured 7.1e-5
    (lr 1e-3, eight updates); on the reference, weight decay 0 instead moves an entry by 1.1e-3 and
    betas (0.9, 0.999) by 5.3e-4, past the 2e-4 allowed."""
    _skyrl_ready()
    from rlaudit.targets.peers.skyrl_train import output, train_steps  # lazy: slow path only
    model = builtin.tiny_model_path()
    batch = builtin.rollout(model)
    cfg = _config(optim={"name": "adamw", "lr": 1e-3, "weight_decay": 0.1,
                         "betas": [0.9, 0.95], "eps": 1e-8})
    (result,) = train_steps(model, [(batch, cfg, 2)], version=PINNED)
    got = output(result, batch)
    ref = ReferenceAdapter().train_step(model_path=model, batch=batch, config=cfg, steps=2)
    for step in range(2):
        for name, value in got.metrics[step].items():
            assert value == pytest.approx(float(ref.metrics[step][name]), rel=RTOL, abs=1e-6), \
                (step, name)
        for name, p in got.params[step].items():
            torch.testing.assert_close(p.double().flatten(),
                                       ref.params[step][name].double().flatten(), rtol=0,
                                       atol=2e-4, msg=name)
