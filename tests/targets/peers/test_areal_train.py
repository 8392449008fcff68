"""AReaL 1.0.4's own update on CPU (rlaudit.targets.peers.areal_train) against rlaudit's
reference update on the built-in rollout (8 rows, two groups of 4, temperature 0.7, a row with
an empty response, holes in response_mask): two steps of GRPO, PPO-clip token-mean, SGD, no KL,
one mini-batch, float32 on both sides. The reference is an independent implementation of the same
step (rlaudit/update), so a wrong layout, shift, temperature or loss weighting on AReaL's side
moves log-probs, advantages, metrics or parameters well past float32 noise.

The settings AReaL's step is not mapped for are reported, never run (pure functions: no AReaL
needed).
"""

from __future__ import annotations

import pytest
import torch

from rlaudit.config import load_config
from rlaudit.targets.contract.own_adapters import ReferenceAdapter
from rlaudit.targets.inputs import builtin
from rlaudit.targets.peers import peers_dir
from rlaudit.targets.peers.areal_train import rows_unsupported, unsupported

PINNED = "1.0.4"
#: float32 on both sides, different reduction orders
RTOL = 1e-4


def _config(dtype="float32", **actor):
    cfg = dict(builtin.CONFIG)
    cfg["actor"] = {**cfg["actor"], "ppo_epochs": 1, "ppo_mini_batch_size": 2, **actor}
    cfg["trainer"] = {**cfg["trainer"], "dtype": dtype}
    return load_config(cfg)


def test_unmapped_settings_are_named():
    assert unsupported(_config()) == []
    why = unsupported(load_config(builtin.CONFIG))
    assert why == ["actor.ppo_epochs=2 (_ppo_update makes one pass)"]
    assert any("use_kl_loss" in w for w in unsupported(_config(use_kl_loss=True)))
    assert any("loss_mode" in w for w in unsupported(_config(loss_mode="gspo")))
    assert any("trainer.dtype" in w for w in unsupported(_config(dtype="bfloat16")))


def test_rows_beyond_one_mini_batch_are_not_run():
    # AReaL balances mini-batches by length; the reference cuts them in row order
    assert rows_unsupported(_config(), 8) == ""
    assert "more than one mini-batch" in rows_unsupported(_config(ppo_mini_batch_size=1), 8)
    assert "whole groups" in rows_unsupported(_config(), 6)


@pytest.mark.slow
def test_areal_update_matches_reference_on_builtin_rollout():
    if not (peers_dir() / f"areal-{PINNED}" / "areal" / "__init__.py").is_file():
        pytest.skip(f"areal=={PINNED} is not installed under {peers_dir()} (run `make peers`)")
    from rlaudit.targets.peers.areal_train import output, train_steps  # lazy: slow path only
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
        for name, value in got.metrics[step].items():
            assert value == pytest.approx(float(ref.metrics[step][name]), rel=RTOL, abs=1e-6), \
                (step, name)
        assert set(got.params[step]) == set(ref.params[step])
        for name, p in got.params[step].items():
            torch.testing.assert_close(p.double().flatten(),
                                       ref.params[step][name].double().flatten(), rtol=RTOL,
                                       atol=1e-6, msg=name)
    # the step trained: the parameters moved (lr 0.5) and grad_norm was logged
    assert got.metrics[0]["actor/grad_norm"] > 0
