"""OpenRLHF 0.11.2's own actor training step (rlaudit.targets.peers.openrlhf_train) on CUDA with
NCCL: device and backend are the test's parameters. It cannot run on CPU (OpenRLHF calls CUDA by
name: openrlhf_train.BLOCKERS); on CPU only the layout and the adapter's n/a reason are tested.

One on-policy step on the committed rollout (16 rows, 4 groups of 4), GRPO advantages from
rlaudit's reference handed to OpenRLHF as they are, token-mean, one optimizer step of one
micro-batch (``ppo_train`` logs the token-weighted mean of each micro-batch's loss contribution:
with one micro-batch that is the loss), OpenRLHF's bf16 parameters under fp32 master weights:
- ``policy_loss`` is the on-policy closed form ``-sum(A * mask) / sum(mask)`` (the ratio is 1:
  the old log-probs come from the same weights), worked out here from the advantages;
- ``ppo_clip_ratio`` is 0 and ``ppo_kl`` ~0;
- ``actor_grad_norm`` agrees with the reference's float32 step within bf16's resolution;
- the parameters moved.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rlaudit.config import load_config
from rlaudit.data.io import load_rollout
from rlaudit.targets.contract.own_adapters import ReferenceAdapter
from rlaudit.targets.peers import peers_dir
from rlaudit.targets.peers.openrlhf_train import BLOCKERS, experience_tensors

REPO = Path(__file__).resolve().parents[3]
MODEL = REPO / "scenarios" / "models" / "qwen2-tiny-short"
ROLLOUT = REPO / "scenarios" / "rollouts" / "short-ref.safetensors"
PINNED = "0.11.2"
#: OpenRLHF's command line for the step: what rlaudit's config below says, in its names
ARGV = ["--ds.zero_stage", "0", "--ds.attn_implementation", "sdpa", "--vllm.sync_backend", "gloo",
        "--rollout.n_samples_per_prompt", "4", "--train.batch_size", "16",
        "--train.micro_batch_size", "16", "--train.max_epochs", "1",
        "--actor.loss_agg_mode", "token-mean", "--algo.advantage.estimator", "group_norm",
        "--actor.adam.lr", "1e-3", "--actor.adam.betas", "0.9", "0.95", "--actor.adam.eps",
        "1e-8", "--actor.adam.weight_decay", "0", "--actor.lr_scheduler", "constant",
        "--actor.lr_warmup_ratio", "0", "--actor.max_norm", "1e9"]
#: bf16 parameters (8 bits of mantissa) against the reference's float32
BF16_RTOL = 5e-2


def _config():
    return load_config({"rollout": {"n": 4, "response_length": 12},
                        "actor": {"ppo_mini_batch_size": 4, "ppo_micro_batch_size_per_gpu": 16,
                                  "loss_agg_mode": "token-mean", "grad_clip": 0.0,
                                  "optim": {"name": "adamw", "lr": 1e-3, "betas": [0.9, 0.95],
                                            "eps": 1e-8, "weight_decay": 0.0}},
                        "trainer": {"dtype": "float32"}})


def test_experience_layout_left_pads_prompts_and_right_pads_responses():
    """Two rows by hand: prompts [5, 6] and [7] in a width of 2, responses [8] and [9, 10]."""
    batch = load_rollout(ROLLOUT).select(torch.tensor([0, 1]))
    t = batch.tensors
    t["prompt_ids"] = torch.tensor([[5, 6], [7, 0]])
    t["prompt_lengths"] = torch.tensor([2, 1])
    t["response_ids"] = torch.tensor([[8, 0], [9, 10]])
    t["response_lengths"] = torch.tensor([1, 2])
    t["response_mask"] = torch.tensor([[1, 0], [1, 1]])
    got = experience_tensors(batch)
    assert got["sequences"].tolist() == [[5, 6, 8, 0], [0, 7, 9, 10]]
    assert got["attention_mask"].tolist() == [[1, 1, 1, 0], [0, 1, 1, 1]]
    assert got["action_mask"].tolist() == [[True, False], [True, True]]


def test_blockers_are_the_lines_that_call_cuda():
    """Each named line of the installed release calls CUDA by name (so the n/a reason is true)."""
    root = peers_dir() / f"openrlhf-{PINNED}" / "openrlhf"
    if not root.is_dir():
        pytest.skip(f"openrlhf=={PINNED} is not installed under {peers_dir()} (run `make peers`)")
    for path, line, what in BLOCKERS:
        text = (root / path).read_text().splitlines()
        near = "\n".join(text[line - 1:line + 1])
        assert "cuda" in near or "torch_dist_barrier_and_cuda_sync" in near, (path, line, near)


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU-only case")
def test_on_cpu_the_step_stops_at_the_first_named_blocker():
    """Driven on CPU (gloo), OpenRLHF's own step raises inside the first line BLOCKERS names
    (the path up to there, OpenRLHF's parser, strategy and actor class, is the GPU test's)."""
    if not (peers_dir() / f"openrlhf-{PINNED}" / "openrlhf" / "__init__.py").is_file():
        pytest.skip(f"openrlhf=={PINNED} is not installed under {peers_dir()} (run `make peers`)")
    from rlaudit.errors import RankFailure  # lazy: the slow path only
    from rlaudit.targets.peers.openrlhf_train import train_step  # lazy: as above
    batch = load_rollout(ROLLOUT)
    with pytest.raises(RankFailure) as e:
        train_step(MODEL, batch, torch.zeros(batch.tensors["response_ids"].shape), argv=ARGV,
                   device="cpu", backend="gloo")
    path, line, _ = BLOCKERS[0]
    assert f'{path}", line {line}, in setup_distributed' in str(e.value), str(e.value)[-2000:]


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("device,backend", [("cuda", "nccl")])
def test_openrlhf_actor_step_on_device(device, backend):
    if not (peers_dir() / f"openrlhf-{PINNED}" / "openrlhf" / "__init__.py").is_file():
        pytest.skip(f"openrlhf=={PINNED} is not installed under {peers_dir()} (run `make peers`)")
    from rlaudit.targets.peers.openrlhf_train import train_step  # lazy: the slow path only
    batch = load_rollout(ROLLOUT)
    ref = ReferenceAdapter().train_step(model_path=MODEL, batch=batch, config=_config(), steps=1)
    adv = ref.tokens["advantages"].float()
    mask = batch.tensors["response_mask"].bool()
    out = train_step(MODEL, batch, torch.where(mask, adv, 0.0), argv=ARGV, device=device,
                     backend=backend)
    got = out["metrics"][0]
    closed_form = float(-(adv * mask).sum() / mask.sum())
    assert got["policy_loss"] == pytest.approx(closed_form, rel=1e-3, abs=1e-4)
    assert got["ppo_clip_ratio"] == 0
    assert abs(got["ppo_kl"]) < 1e-3
    want = float(ref.metrics[0]["actor/grad_norm"])
    assert got["actor_grad_norm"] == pytest.approx(want, rel=BF16_RTOL)
    before = load_file(str(MODEL / "model.safetensors"))
    after = out["params"][0]
    assert set(before) <= set(after), set(before) - set(after)
    assert any(not torch.equal(after[n], before[n].float()) for n in before), "nothing moved"
