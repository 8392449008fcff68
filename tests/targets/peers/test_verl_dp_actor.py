"""verl 0.7.1's legacy FSDP actor (rlaudit.targets.peers.verl_dp_actor): its real
``compute_log_prob`` / ``update_policy`` / the trainer's ``_update_actor``, against rlaudit's
reference update on the same batch (one mini-batch of 16 rows in one micro-batch, one SGD step,
no KL, float32), and the entropy flag the Megatron actor ignores (verl PR #6016): with
``entropy_coeff = 0`` and ``calculate_entropy = true`` the FSDP actor logs ``actor/entropy``
(dp_actor.py:580), and only then.

``device`` / ``backend`` are parameters: the CPU (gloo) case runs here, the CUDA (NCCL) one in the
nightly GPU job (marked ``gpu``).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rlaudit.config import load_config
from rlaudit.data.io import load_rollout
from rlaudit.targets.contract.own_adapters import ReferenceAdapter
from rlaudit.targets.peers import peers_dir

REPO = Path(__file__).resolve().parents[3]
MODEL = REPO / "scenarios" / "models" / "qwen2-tiny-short"
ROLLOUT = REPO / "scenarios" / "rollouts" / "short-ref.safetensors"
PEER = peers_dir() / "verl-0.7.1"
#: float32 on both sides, different reduction orders
RTOL = 1e-4


def _missing() -> str:
    if not (PEER / "verl").is_dir():
        return f"verl 0.7.1 is not installed under {PEER.parent} (run `make peers`)"
    if not (PEER / "hydra").is_dir() and importlib.util.find_spec("hydra") is None:
        return f"hydra-core is missing from {PEER} (re-run `make peers`)"
    return ""


pytestmark = [pytest.mark.slow, pytest.mark.skipif(bool(_missing()), reason=_missing())]

_NO_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
DEVICES = [pytest.param(("cpu", "gloo"), id="cpu-gloo"),
           pytest.param(("cuda", "nccl"), id="cuda-nccl", marks=[pytest.mark.gpu, _NO_CUDA])]


def _config(**actor):
    # 16 rows = 4 prompts x n 4: one mini-batch, one micro-batch, one on-policy SGD step
    return load_config({"rollout": {"n": 4, "response_length": 12},
                        "actor": {"ppo_mini_batch_size": 4, "ppo_micro_batch_size_per_gpu": 16,
                                  "optim": {"name": "sgd", "lr": 0.05}, **actor},
                        "data": {"train_batch_size": 4}, "trainer": {"dtype": "float32"}})


CASES = {"calc": {"entropy_coeff": 0.0, "calculate_entropy": True},
         "off": {"entropy_coeff": 0.0, "calculate_entropy": False}}


@pytest.fixture(scope="module", params=DEVICES)
def runs(request):
    from rlaudit.targets.peers.verl_dp_actor import train_steps
    device, backend = request.param
    batch = load_rollout(ROLLOUT)
    out = train_steps(MODEL, [(batch, _config(**c), 1) for c in CASES.values()], peer=str(PEER),
                      device=device, backend=backend)
    return dict(zip(CASES, out))


def test_entropy_follows_calculate_entropy(runs):
    calc, off = runs["calc"]["metrics"][0], runs["off"]["metrics"][0]
    assert "actor/entropy" in calc and "actor/entropy" not in off, (sorted(calc), sorted(off))
    # the entropy of a policy over the 264-token vocabulary lies in (0, log 264]
    assert 0.0 < calc["actor/entropy"] <= torch.log(torch.tensor(264.0)).item()
    assert calc["actor/grad_norm"] == off["actor/grad_norm"]       # a metric, not a loss term


def test_dp_actor_step_matches_reference(runs):
    got = runs["off"]
    ref = ReferenceAdapter().train_step(model_path=MODEL, batch=load_rollout(ROLLOUT),
                                        config=_config(**CASES["off"]), steps=1)
    for key in ("actor/pg_loss", "actor/grad_norm"):
        assert got["metrics"][0][key] == pytest.approx(float(ref.metrics[0][key]), rel=RTOL,
                                                       abs=1e-6), key
    assert got["metrics"][0]["actor/ppo_kl"] == pytest.approx(0.0, abs=1e-6)   # on-policy
    params = got["params"][0]
    assert set(params) == set(ref.params[0])
    for name, value in params.items():
        torch.testing.assert_close(value.cpu().reshape(-1),
                                   ref.params[0][name].reshape(-1).float(),
                                   rtol=RTOL, atol=1e-6, msg=name)
    before = load_file(str(MODEL / "model.safetensors"))
    moved = max((params[n].cpu().reshape(-1) - before[n].reshape(-1).float()).abs().max().item()
                for n in params if n in before)
    assert moved > 1e-4                                  # the optimizer really stepped
