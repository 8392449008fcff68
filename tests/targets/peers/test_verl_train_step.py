"""verl 0.9.1's real FSDP training step on CPU (rlaudit.targets.peers.verl_train) against rlaudit's
own reference update on the same batch and config: an independent computation of the same step
(old log-probs, GRPO advantages, two SGD optimizer steps of the PPO-clip loss, token-mean, no KL,
entropy_coeff 0), float32 on both sides.

The last test runs the same step on CUDA with NCCL (marked ``gpu``, for the nightly job): device
and backend are its parameters.

verl's pg_loss is the global mini-batch value (rlaudit's default ``metric_reduction``,
"contribution"), but its pg_clipfrac / ppo_kl are means over micro-batches (verl's Metric
aggregation): those two are compared with the reference run under the declared convention
``trainer.metric_reduction: microbatch-mean`` (which changes metrics only, not the update).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from verl091 import MODEL, missing

from rlaudit.config import load_config
from rlaudit.data.io import load_rollout
from rlaudit.targets.contract.own_adapters import ReferenceAdapter
from rlaudit.targets.peers.verl_train import train_step

REPO = Path(__file__).resolve().parents[3]
ROLLOUT = REPO / "scenarios" / "rollouts" / "short-ref.safetensors"
#: float32 on both sides, different reduction orders
RTOL = 1e-4


pytestmark = [pytest.mark.slow, pytest.mark.skipif(bool(missing()), reason=missing())]


def _config(reduction: str = "contribution"):
    # 16 rows (4 prompts x n 4), mini-batch 2 prompts = 8 rows: two optimizer steps, so the
    # second one is off-policy (ratio != 1, clipping can happen)
    return load_config({"rollout": {"n": 4, "response_length": 12},
                        "actor": {"ppo_mini_batch_size": 2, "ppo_micro_batch_size_per_gpu": 4,
                                  "optim": {"name": "sgd", "lr": 0.05}},
                        "trainer": {"dtype": "float32", "metric_reduction": reduction}})


def _dp_ordered():
    """The rollout's rows reordered to [0-3, 8-11, 4-7, 12-15]: verl's dispatch chunks a batch
    over dp ranks first and each rank then cuts ITS rows into mini-batches, so at dp 2 optimizer
    step k trains rank 0's k-th half plus rank 1's k-th half (rows 0-3 + 8-11, then 4-7 + 12-15),
    where dp 1 trains 0-7 then 8-15. In this order dp 1, dp 2 and rlaudit's reference (which
    cuts mini-batches before sharding) train the same rows at each step. GRPO groups (4
    consecutive rows) stay whole."""
    order = torch.cat([torch.arange(0, 4), torch.arange(8, 12), torch.arange(4, 8),
                       torch.arange(12, 16)])
    return load_rollout(ROLLOUT).select(order)


@pytest.fixture(scope="module")
def verl_dp1():
    return train_step(MODEL, _dp_ordered(), _config(), dp=1)


def test_verl_fsdp_step_matches_reference(verl_dp1):
    ref, micro_ref = (ReferenceAdapter().train_step(model_path=MODEL, batch=_dp_ordered(),
                                                    config=_config(reduction), steps=1)
                      for reduction in ("contribution", "microbatch-mean"))
    got = verl_dp1["metrics"][0]
    for key, want in (("actor/pg_loss", ref), ("actor/grad_norm", ref),
                      ("actor/pg_clipfrac", micro_ref), ("actor/ppo_kl", micro_ref)):
        assert got[key] == pytest.approx(float(want.metrics[0][key]), rel=RTOL, abs=1e-6), key
    assert got["actor/pg_loss"] != 0 and got["actor/pg_clipfrac"] > 0   # not a vacuous step
    params = verl_dp1["params"][0]
    assert set(params) == set(ref.params[0])
    before = load_file(str(MODEL / "model.safetensors"))
    moved = max((params[n].reshape(-1) - before[n].reshape(-1).float()).abs().max().item()
                for n in params)
    assert moved > 1e-3                              # the optimizer really stepped
    for name, value in ref.params[0].items():
        torch.testing.assert_close(params[name].reshape(-1), value.reshape(-1).float(),
                                   rtol=RTOL, atol=1e-6, msg=name)


def test_verl_fsdp_step_dp2_equals_dp1(verl_dp1):
    # the rollout in its own order: at dp 2 verl trains the rows of _dp_ordered's steps
    dp2 = train_step(MODEL, load_rollout(ROLLOUT), _config(), dp=2)
    for key in ("actor/pg_loss", "actor/grad_norm"):
        assert dp2["metrics"][0][key] == pytest.approx(verl_dp1["metrics"][0][key], rel=RTOL), key
    for name, value in verl_dp1["params"][0].items():
        torch.testing.assert_close(dp2["params"][0][name], value, rtol=RTOL, atol=1e-6, msg=name)



@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("device,backend,dp", [("cuda", "nccl", 1), ("cuda", "nccl", 2)])
def test_verl_fsdp_step_on_device(verl_dp1, device, backend, dp):
    """The same step on verl's own platform (nvidia) with NCCL: as the CPU step (float32 on
    both; GPU kernels reduce in other orders, hence 10x the CPU tolerance)."""
    if torch.cuda.device_count() < dp:
        pytest.skip(f"needs {dp} CUDA devices")
    batch = _dp_ordered() if dp == 1 else load_rollout(ROLLOUT)
    got = train_step(MODEL, batch, _config(), dp=dp, device=device, backend=backend)
    for key in ("actor/pg_loss", "actor/grad_norm"):
        assert got["metrics"][0][key] == pytest.approx(verl_dp1["metrics"][0][key],
                                                       rel=10 * RTOL), key
    for name, value in verl_dp1["params"][0].items():
        torch.testing.assert_close(got["params"][0][name].cpu(), value, rtol=10 * RTOL,
                                   atol=1e-5, msg=name)
