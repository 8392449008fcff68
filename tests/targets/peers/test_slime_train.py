"""slime's own Megatron actor step on CPU (rlaudit.targets.peers.slime_train) against rlaudit's
reference update.

The parity test runs two optimizer steps (two mini-batches of one group of 4), token-mean,
PPO-clip, SGD, float32 on both sides. Its rows are the built-in rollout's first group twice (the
second copy a group of its own): every row has a trained token, so slime's per-token normaliser
(which counts a sample without a loss-mask token as one token: a declared difference) equals the
reference's token count, and nothing but float32 noise may separate the two. The reference is an
independent implementation (rlaudit/update); a wrong layout, shift, temperature, reward
normalisation or loss scaling on slime's side moves log-probs, advantages, metrics or parameters
far past that noise.

The settings slime's step is not mapped for are reported, never run (pure functions: no slime).
"""

from __future__ import annotations

import pytest
import torch

from rlaudit.config import load_config
from rlaudit.errors import InputError
from rlaudit.targets import peers
from rlaudit.targets.contract.own_adapters import ReferenceAdapter
from rlaudit.targets.inputs import builtin
from rlaudit.targets.peers.slime_train import rows_unsupported, unsupported

AFTER = "624b824a8"
#: float32 on both sides, different reduction orders
RTOL = 1e-4
#: an embedding row's gradient sums every occurrence of its token in another order (measured:
#: 3.2e-6 at most after two SGD steps at lr 0.5, every other tensor under 1.5e-6)
PARAM_ATOL = 1e-5


def _config(dtype="float32", **actor):
    cfg = dict(builtin.CONFIG)
    cfg["actor"] = {**cfg["actor"], "ppo_epochs": 1, "loss_agg_mode": "token-mean", **actor}
    cfg["trainer"] = {**cfg["trainer"], "dtype": dtype}
    return load_config(cfg)


def test_unmapped_settings_are_named():
    assert unsupported(_config()) == []
    assert unsupported(load_config(builtin.CONFIG)) == [
        "actor.ppo_epochs=2 (slime passes over a rollout once)"]
    assert any("use_kl_loss" in w for w in unsupported(_config(use_kl_loss=True)))
    assert any("loss_mode" in w for w in unsupported(_config(loss_mode="gspo")))
    assert any("loss_agg_mode" in w for w in unsupported(
        _config(loss_agg_mode="seq-mean-token-sum")))
    assert any("trainer.dtype" in w for w in unsupported(_config(dtype="bfloat16")))


def test_rows_slime_cannot_take_are_named():
    cfg = _config(ppo_mini_batch_size=1)        # mini-batches of 4 rows
    assert rows_unsupported(cfg, 8) == ""
    assert "whole groups" in rows_unsupported(cfg, 6)
    # one optimizer step: slime reads the rollout engine's log-probs, which it always sends
    assert "rollout_log_probs" in rows_unsupported(cfg, 4, fields=())
    assert rows_unsupported(cfg, 4) == ""


def _two_groups_without_empty_rows(batch):
    """Rows 0-3 of the built-in rollout (one group, every row with a trained token) twice, the
    second copy its own group."""
    twice = batch.select([0, 1, 2, 3, 0, 1, 2, 3])
    twice.tensors["uid"] = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    assert bool(twice.tensors["response_mask"].any(dim=1).all())
    return twice


@pytest.mark.slow
def test_slime_step_matches_reference_on_builtin_rollout():
    try:
        path, _ = peers.source_snapshot("slime", AFTER)
    except InputError as e:
        pytest.skip(f"slime snapshot absent: {e}")
    from rlaudit.targets.peers.slime_train import output, train_steps  # lazy: slow path only
    model = builtin.tiny_model_path()
    batch = _two_groups_without_empty_rows(builtin.rollout(model))
    cfg = _config(ppo_mini_batch_size=1)
    (result,) = train_steps(model, [(batch, cfg, 2)], snapshot=str(path))
    got = output(result, batch)
    ref = ReferenceAdapter().train_step(model_path=model, batch=batch, config=cfg, steps=2)
    mask = batch["response_mask"].bool()
    torch.testing.assert_close(got.log_probs[mask], ref.log_probs.double()[mask], rtol=RTOL,
                               atol=1e-5)
    torch.testing.assert_close(got.tokens["advantages"][mask],
                               ref.tokens["advantages"].double()[mask], rtol=RTOL, atol=1e-6)
    for step in range(2):
        assert set(got.metrics[step]) >= {"actor/pg_loss", "actor/grad_norm", "actor/ppo_kl"}
        for name, value in got.metrics[step].items():
            assert value == pytest.approx(float(ref.metrics[step][name]), rel=RTOL, abs=1e-6), \
                (step, name)
        assert set(got.params[step]) == set(ref.params[step])
        for name, p in got.params[step].items():
            torch.testing.assert_close(p.double().flatten(),
                                       ref.params[step][name].double().flatten(), rtol=RTOL,
                                       atol=PARAM_ATOL, msg=name)
    # the step trained: the parameters moved (lr 0.5) and two optimizer steps were logged
    assert got.metrics[0]["actor/grad_norm"] > 0
    assert len([d for d in result["raw_metrics"][0] if "train/step" in d]) == 2


def test_step_metrics_average_optimizer_steps_and_keep_catalogue_meanings():
    from rlaudit.targets.peers.slime_step import step_metrics  # lazy: a rank module (no slime)
    logs = [{"rollout/log_probs": -2.0, "rollout/step": 0},       # not an optimizer step
            {"train/pg_loss": -0.25, "train/ppo_kl": 0.0, "train/pg_clipfrac": 0.5,
             "train/grad_norm": 3.0, "train/lr-pg_0": 0.5, "train/step": 0},
            {"train/pg_loss": -0.75, "train/ppo_kl": 0.25, "train/pg_clipfrac": 0.0,
             "train/grad_norm": 5.0, "train/lr-pg_0": 0.5, "train/step": 1}]
    assert step_metrics(logs, per_token=True) == {
        "actor/pg_loss": -0.5, "actor/ppo_kl": 0.125, "actor/pg_clipfrac": 0.25,
        "actor/grad_norm": 4.0, "actor/lr": 0.5}
    # per-sample means: slime's clip fraction and ppo_kl are means of per-sample means, not the
    # catalogue's token-means
    assert set(step_metrics(logs, per_token=False)) == {"actor/pg_loss", "actor/grad_norm",
                                                         "actor/lr"}


@pytest.mark.slow
def test_slime_backend_parity_on_ppo_dual_clip_differs_on_ppo_kl_only(tmp_path):
    """``rlaudit run --target slime ppo_dual_clip`` (SGD lr 2.0, no clipping: after the first
    training step some tokens' log-ratios pass 20 nats): backend-parity runs and differs only on
    ``actor/ppo_kl`` of step 1, as declared (slime does not clamp the log-ratio, the reference
    clamps it at +-20); the loss, clip fraction, grad_norm and parameters agree."""
    import json  # lazy: slow path only
    import os  # lazy: as above
    import subprocess  # lazy: as above
    import sys  # lazy: as above
    from pathlib import Path  # lazy: as above
    try:
        peers.source_snapshot("slime", AFTER)
    except InputError as e:
        pytest.skip(f"slime snapshot absent: {e}")
    repo = Path(__file__).resolve().parents[3]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(repo), *filter(None, [os.environ.get("PYTHONPATH")])]))
    proc = subprocess.run(
        [sys.executable, "-m", "rlaudit.cli.main", "run", "--target", f"slime=={AFTER}",
         "ppo_dual_clip", "--json", "--no-mlflow", "--report-dir", str(tmp_path)],
        cwd=repo, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (scenario,) = [r for r in json.loads(proc.stdout) if r["scenario"] == "ppo_dual_clip"]
    got = {c["invariant"]: c for c in scenario["checks"] if c["backend"].startswith("slime")}
    assert got["backend-parity"]["status"] == "differs"
    details = got["backend-parity"]["details"]
    assert set(details["differences"]) == {"ppo-kl-log-ratio-unclamped"}
    assert {(f["metric"], f["step"]) for f in details["failures"]} == {("actor/ppo_kl", 1)}
    # slime's unclamped mean is the larger: clamping tokens past 20 nats lowers the reference's
    assert all(f["got"] > f["want"] for f in details["failures"])
    assert got["grad-norm-identity"]["status"] == "pass"
