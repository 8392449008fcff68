"""verl 0.9.1's Megatron engine, the column's path (rlaudit.targets.peers.verl_mcore.train_steps):
verl's own engine worker with ``strategy: megatron`` in bf16 (all McoreEngineConfig accepts) on
megatron-core through mbridge, one on-policy SGD step, against rlaudit's reference (float32) on
the same batch within bf16 tolerances.

``device`` / ``backend`` are parameters: the CPU case (gloo) is tests/targets/peers/
test_verl_mcore.py; here the same code on CUDA with NCCL, marked ``gpu`` for the nightly job.
The CPU part here checks what this path hands verl: the overrides.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from rlaudit.config import load_config
from rlaudit.data.io import load_rollout
from rlaudit.targets.contract.own_adapters import ReferenceAdapter
from rlaudit.targets.peers import peers_dir
from rlaudit.targets.peers.verl_mcore import overrides

REPO = Path(__file__).resolve().parents[3]
MODEL = REPO / "scenarios" / "models" / "qwen2-tiny-short"
ROLLOUT = REPO / "scenarios" / "rollouts" / "short-ref.safetensors"
PEER = peers_dir() / "verl-0.9.1"
#: bf16 keeps 8 bits of mantissa (relative step 2**-8 = 0.4%); a forward and backward of a
#: two-layer model in it, against float32, stays within a few of those steps
RTOL = 3e-2


def _found(name: str) -> bool:
    return (PEER / name).is_dir() or importlib.util.find_spec(name) is not None


def _missing() -> str:
    if not (PEER / "verl").is_dir():
        return f"verl 0.9.1 is not installed under {PEER.parent} (run `make peers`)"
    for module in ("hydra", "megatron", "mbridge"):
        if not _found(module):
            return f"{module} is not installed (verl 0.9.1's Megatron engine needs it)"
    if not torch.cuda.is_available():
        return "no CUDA device (the CPU case is tests/targets/peers/test_verl_mcore.py)"
    return ""


def _config():
    # 16 rows = 4 prompts x n 4: one mini-batch in one micro-batch, one on-policy SGD step;
    # the entropy asked for with a zero coefficient (verl #6016's case)
    return load_config({"rollout": {"n": 4, "response_length": 12},
                        "actor": {"ppo_mini_batch_size": 4, "ppo_micro_batch_size_per_gpu": 16,
                                  "entropy_coeff": 0.0, "calculate_entropy": True,
                                  "optim": {"name": "sgd", "lr": 0.05}},
                        "data": {"train_batch_size": 4}, "trainer": {"dtype": "float32"}})


def test_overrides_switch_the_engine_not_the_algorithm():
    actor = "actor_rollout_ref.actor"
    fsdp = {f"{actor}.strategy": "fsdp2", f"{actor}.fsdp_config.dtype": "float32",
            f"{actor}.use_torch_compile": False, f"{actor}.optim.optimizer": "AdamW",
            f"{actor}.clip_ratio": 0.2, f"{actor}.optim.lr": 0.05}
    got = overrides(fsdp, "adamw", 1e-8)
    assert not any(".fsdp_config." in k for k in got)
    assert f"{actor}.use_torch_compile" not in got
    assert got[f"{actor}.strategy"] == "megatron"
    assert got[f"{actor}.megatron.dtype"] == "bfloat16"
    assert got[f"{actor}.megatron.vanilla_mbridge"] is True          # mbridge, pinned
    assert got[f"{actor}.optim.total_training_steps"] == 1
    assert got[f"{actor}.optim.optimizer"] == "adam"          # megatron-core's name
    assert got[f"{actor}.optim.override_optimizer_config"] == {"adam_eps": 1e-8}
    assert got[f"{actor}.clip_ratio"] == 0.2 and got[f"{actor}.optim.lr"] == 0.05
    sgd = overrides(fsdp, "sgd", 1e-8)
    assert sgd[f"{actor}.optim.optimizer"] == "sgd"
    # torch's SGD (rlaudit's) has no momentum; megatron-core's defaults to 0.9
    assert sgd[f"{actor}.optim.override_optimizer_config"] == {"sgd_momentum": 0.0}


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.skipif(bool(_missing()), reason=_missing() or "-")
@pytest.mark.parametrize("device,backend", [("cuda", "nccl")])
def test_megatron_engine_step_matches_reference(device, backend):
    # lazy: the full path is imported only where it can run
    from rlaudit.targets.peers.verl_mcore import train_steps
    from rlaudit.targets.peers.verl_step import catalogue_metrics  # lazy: as above

    batch = load_rollout(ROLLOUT)
    (result,) = train_steps(MODEL, [(batch, _config(), 1)], peer=str(PEER), device=device,
                            backend=backend)
    got = catalogue_metrics(result["metrics"][0])
    ref = ReferenceAdapter().train_step(model_path=MODEL, batch=load_rollout(ROLLOUT),
                                        config=_config(), steps=1).metrics[0]
    for key in ("actor/pg_loss", "actor/grad_norm", "actor/entropy"):
        assert key in got, sorted(got)
        assert got[key] == pytest.approx(float(ref[key]), rel=RTOL, abs=1e-3), key
    assert float(ref["actor/grad_norm"]) > 0                   # not a vacuous step
    # on-policy: every ratio is 1 up to bf16 rounding, so the drift is ~0
    assert got["actor/ppo_kl"] == pytest.approx(0.0, abs=1e-2)
