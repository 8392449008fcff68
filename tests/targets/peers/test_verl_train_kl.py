"""KL and rollout IS through verl 0.9.1's real FSDP training step on CPU (verl_train / verl_kl)
against rlaudit's own reference update on the same batch and config (an independent
computation), float32 on both sides, and against hand formulas on verl's own tensors:

- KL: the actor's KL loss (k2, coefficient 0.1) and KL in reward (k2, coefficient 0.05) against a
  reference policy that differs from the actor (qwen2-tiny vs qwen2-tiny-short): verl's reference
  worker, ``apply_kl_penalty`` and ``ppo_loss``'s KL term;
- rollout IS: sequence-level truncated IS at 1.5 on a stale rollout (log-ratios O(0.1..1)):
  ``compute_rollout_correction_and_add_to_batch`` and the weighted policy loss.

Each is also run with verl broken inside its ranks (k2 without its 1/2; the IS weights dropped
from the batch): the same comparison then fails, so it can.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from verl091 import MODEL, missing

from rlaudit.config import load_config
from rlaudit.data.io import load_rollout
from rlaudit.scenarios.invariants.rollout_corr import naive_is_weights
from rlaudit.targets.contract.own_adapters import ReferenceAdapter
from rlaudit.targets.peers.verl_train import train_rank, train_steps

REPO = Path(__file__).resolve().parents[3]
#: float32 on both sides, different reduction orders
RTOL = 1e-4
REF_MODEL = REPO / "scenarios" / "models" / "qwen2-tiny"
KL_ROLLOUT = REPO / "scenarios" / "rollouts" / "short-ref.safetensors"
IS_ROLLOUT = REPO / "scenarios" / "rollouts" / "short-stale.safetensors"
KL_COEF, KL_LOSS_COEF, IS_THRESHOLD = 0.05, 0.1, 1.5

pytestmark = [pytest.mark.slow, pytest.mark.skipif(bool(missing()), reason=missing())]


def _config(**extra):
    # 16 rows, mini-batches of 8 rows: two optimizer steps, the second off-policy
    raw = {"rollout": {"n": 4, "response_length": 12},
           "actor": {"ppo_mini_batch_size": 2, "ppo_micro_batch_size_per_gpu": 4,
                     "optim": {"name": "sgd", "lr": 0.05}},
           "trainer": {"dtype": "float32"}}
    for section, values in extra.items():
        raw.setdefault(section, {}).update(values)
    return load_config(raw)


KL = _config(algorithm={"use_kl_in_reward": True, "kl_penalty": "mse", "kl_coef": KL_COEF},
             actor={"use_kl_loss": True, "kl_loss_type": "mse", "kl_loss_coef": KL_LOSS_COEF})
IS = _config(actor={"rollout_correction": {"rollout_is": "sequence",
                                           "rollout_is_threshold": IS_THRESHOLD}})


def _jobs():
    return [(load_rollout(KL_ROLLOUT), KL, 1), (load_rollout(IS_ROLLOUT), IS, 1)]


def broken_rank(info, request):
    """verl_train's rank body with verl broken first (after the CPU platform is selected, as
    train_rank does): k2 without its 1/2 (core_algos.kl_penalty_forward, read by
    apply_kl_penalty and the KL loss alike), and the IS weights that
    compute_rollout_correction_and_add_to_batch adds dropped from the batch. The KL job has
    no rollout correction and the IS job no KL: each job meets one fault."""
    import sys  # lazy: the rank's own path set-up, as train_rank's
    sys.path.insert(0, request["peer"])
    from rlaudit.targets.peers import verl_cpu  # lazy: verl only inside the rank
    verl_cpu.select()
    from verl.trainer.ppo import core_algos, rollout_corr_helper  # lazy: as above
    real_kl = core_algos.kl_penalty_forward
    real_is = rollout_corr_helper.compute_rollout_correction_and_add_to_batch

    def no_half(logprob, ref_logprob, kl_penalty):
        out = real_kl(logprob, ref_logprob, kl_penalty)
        return 2 * out if kl_penalty in ("mse", "k2") else out

    def unweighted(batch, config):
        batch, metrics = real_is(batch, config)
        batch.batch.pop("rollout_is_weights", None)
        return batch, metrics

    core_algos.kl_penalty_forward = no_half
    rollout_corr_helper.compute_rollout_correction_and_add_to_batch = unweighted
    return train_rank(info, request)


def _verl(rank=None):
    return train_steps(MODEL, _jobs(), dp=1, ref_model_path=REF_MODEL, rank=rank)


@pytest.fixture(scope="module")
def verl_runs():
    return _verl()


@pytest.fixture(scope="module")
def reference():
    ref = ReferenceAdapter()
    return [ref.train_step(model_path=MODEL, ref_model_path=REF_MODEL, batch=batch, config=cfg,
                           steps=steps) for batch, cfg, steps in _jobs()]


def _close(a, b) -> bool:
    return math.isclose(float(a), float(b), rel_tol=RTOL, abs_tol=1e-6)


def _kl_mismatches(got: dict, ref) -> list[str]:
    """What of verl's KL step disagrees with the reference run ``ref``: its metrics, the
    rewards it trained on, the parameters after the step."""
    bad = [k for k in ("actor/kl_loss", "actor/kl_coef", "actor/pg_loss", "actor/loss",
                       "actor/grad_norm", "critic/rewards/mean")
           if not _close(got["metrics"][0][k], ref.metrics[0][k])]
    return bad + _tensor_mismatches(got, ref, "token_level_rewards")


def _is_mismatches(got: dict, ref) -> list[str]:
    names = {"rollout_corr/rollout_is_mean": "rollout_corr/is_weight_mean",
             "rollout_corr/rollout_is_ratio_fraction_high": "rollout_corr/is_clipfrac",
             "actor/pg_loss": "actor/pg_loss", "actor/grad_norm": "actor/grad_norm"}
    bad = [theirs for theirs, ours in names.items()
           if not _close(got["metrics"][0][theirs], ref.metrics[0][ours])]
    return bad + _tensor_mismatches(got, ref, None)


def _tensor_mismatches(got: dict, ref, token: str | None) -> list[str]:
    bad = []
    if token is not None:
        mask = ref.tokens[token] != 0
        mine = got["tokens"][token][:, :mask.shape[1]].double()
        if not torch.allclose(mine[mask], ref.tokens[token][mask].double(), rtol=RTOL,
                              atol=1e-5):
            bad.append(token)
    for name, value in ref.params[0].items():
        if not torch.allclose(got["params"][0][name].reshape(-1), value.reshape(-1).float(),
                              rtol=RTOL, atol=1e-6):
            bad.append(f"param {name}")
    return bad


def test_kl_loss_and_kl_in_reward_match_the_reference(verl_runs, reference):
    got, ref = verl_runs[0], reference[0]
    assert _kl_mismatches(got, ref) == []
    metrics = got["metrics"][0]
    assert metrics["actor/kl_coef"] == KL_LOSS_COEF
    assert metrics["actor/kl_loss"] > 1.0           # the reference policy really differs
    # KL in reward by hand on verl's own tensors: score on the last response token minus
    # 0.05 x (old - ref)^2 / 2 on every valid token
    batch = load_rollout(KL_ROLLOUT)
    mask = batch.mask.bool()
    width = mask.shape[1]
    old = got["tokens"]["old_log_probs"][:, :width].double()
    ref_lp = got["tokens"]["ref_log_prob"][:, :width].double()
    want = -KL_COEF * 0.5 * (old - ref_lp) ** 2
    last = batch["response_lengths"] - 1
    want[torch.arange(len(batch)), last] += batch["scores"].double()
    rewards = got["tokens"]["token_level_rewards"][:, :width].double()
    torch.testing.assert_close(rewards[mask], want[mask], rtol=1e-5, atol=1e-6)
    # verl's reference log-probs are rlaudit's reference policy's
    torch.testing.assert_close(ref_lp[mask], ref.tokens["ref_log_probs"][mask].double(),
                               rtol=RTOL, atol=1e-5)


def test_rollout_is_matches_the_reference(verl_runs, reference):
    got, ref = verl_runs[1], reference[1]
    assert _is_mismatches(got, ref) == []
    batch = load_rollout(IS_ROLLOUT)
    mask = batch.mask.bool()
    width = mask.shape[1]
    old = got["tokens"]["old_log_probs"][:, :width].double()
    weights, outside = naive_is_weights(old, batch["rollout_log_probs"].double(), mask,
                                        level="sequence", threshold=IS_THRESHOLD,
                                        mode="truncate", lower=None)
    want = torch.tensor(weights, dtype=torch.float64)
    mine = got["tokens"]["rollout_is_weights"][:, :width].double()
    torch.testing.assert_close(mine[mask], want[mask], rtol=1e-5, atol=1e-6)
    truncated_rows = sum(any(row) for row in outside)
    assert 0 < truncated_rows < len(batch)           # the threshold is active, not everywhere
    assert got["metrics"][0]["rollout_corr/rollout_is_ratio_fraction_high"] == pytest.approx(
        truncated_rows / len(batch))


def test_a_broken_verl_is_caught(reference):
    kl, rollout_is = _verl(rank=broken_rank)
    bad = _kl_mismatches(kl, reference[0])
    assert {"actor/kl_loss", "token_level_rewards"} <= set(bad), bad
    bad = _is_mismatches(rollout_is, reference[1])
    assert {"actor/pg_loss", "actor/grad_norm"} <= set(bad), bad
    # the IS metrics are computed before the weights are dropped: still verl's own
    assert "rollout_corr/rollout_is_mean" not in bad


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_kl_and_rollout_is_on_device(verl_runs):
    """The same two jobs on verl's own platform (nvidia) with NCCL, the reference worker
    forward-only as verl builds it there (pinned offload): as on the CPU, at 10x the tolerance
    (GPU kernels reduce in other orders)."""
    got = train_steps(MODEL, _jobs(), dp=1, ref_model_path=REF_MODEL, device="cuda",
                      backend="nccl")
    for mine, cpu in zip(got, verl_runs):
        for key in ("actor/pg_loss", "actor/grad_norm"):
            assert mine["metrics"][0][key] == pytest.approx(cpu["metrics"][0][key],
                                                            rel=10 * RTOL), key
    assert got[0]["metrics"][0]["actor/kl_loss"] == pytest.approx(
        verl_runs[0]["metrics"][0]["actor/kl_loss"], rel=10 * RTOL)
    assert got[1]["metrics"][0]["rollout_corr/rollout_is_mean"] == pytest.approx(
        verl_runs[1]["metrics"][0]["rollout_corr/rollout_is_mean"], rel=10 * RTOL)
