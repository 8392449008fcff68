"""How rlaudit's config and batch are handed to verl's training step (no verl run, no verl
import): what cannot be mapped is named, rlaudit's "no clipping" stays no clipping in verl, and
responses are laid out at the width verl's rollout pads them to."""

from __future__ import annotations

from pathlib import Path

import torch

from rlaudit.config import load_config
from rlaudit.data.io import load_rollout

ROLLOUT = Path(__file__).resolve().parents[3] / "scenarios" / "rollouts" / "short-ref.safetensors"


def _config():
    return load_config({"rollout": {"n": 4, "response_length": 12},
                        "actor": {"ppo_mini_batch_size": 2, "ppo_micro_batch_size_per_gpu": 4,
                                  "optim": {"name": "sgd", "lr": 0.05}},
                        "trainer": {"dtype": "float32"}})


def test_unsupported_names_each_setting_it_cannot_map():
    from rlaudit.targets.peers.verl_train import unsupported
    assert unsupported(_config()) == []
    assert unsupported(load_config({"trainer": {"dtype": "float64"}})) == []   # run in float32
    # the KL loss and KL in reward are mapped (through verl's reference worker, verl_kl.py)
    assert unsupported(load_config({"actor": {"use_kl_loss": True}})) == []
    cases = {"rollout-KL": ({"actor": {"rollout_correction": {"use_rollout_kl_loss": True}}},
                            "rollout-KL"),
             "bf16": ({"trainer": {"dtype": "bfloat16"}}, "trainer.dtype"),
             "gae": ({"algorithm": {"adv_estimator": "gae"}}, "adv_estimator"),
             "norm": ({"actor": {"loss_agg_mode": "seq-mean-token-sum-norm"}},
                      "loss_scale_factor"),
             "padding": ({"trainer": {"extra_padding_microbatches": 1}}, "padding"),
             # 2 prompts x 4 = 8 rows per mini-batch, micro-batches of 3: verl asserts
             "uneven": ({"actor": {"ppo_mini_batch_size": 2, "ppo_micro_batch_size_per_gpu": 3},
                         "rollout": {"n": 4}}, "divide")}
    for name, (cfg, word) in cases.items():
        why = unsupported(load_config(cfg))
        assert len(why) == 1 and word in why[0], (name, why)


def test_grad_clip_zero_means_no_clipping_in_verl_too():
    from rlaudit.targets.peers.verl_train import verl_overrides
    key = "actor_rollout_ref.actor.optim.clip_grad"
    for clip, want in ((1.0, 1.0), (0.0, float("inf")), (-1.0, float("inf"))):
        cfg = load_config({"actor": {"grad_clip": clip}})
        assert verl_overrides(cfg, model_path="m", dp=1)[key] == want
    # why inf: clip_grad_norm_ (what verl's engine calls) zeroes the gradient at max_norm 0 and
    # leaves it exactly as it is at inf
    for max_norm, scale in ((0.0, 0.0), (float("inf"), 1.0)):
        p = torch.nn.Parameter(torch.ones(3))
        p.grad = torch.tensor([3.0, 4.0, 0.0])
        torch.nn.utils.clip_grad_norm_([p], max_norm=max_norm)
        assert p.grad.tolist() == [3.0 * scale, 4.0 * scale, 0.0]


def test_responses_laid_out_at_the_rollout_width():
    from rlaudit.targets.peers.verl_layout import to_batch_width, verl_tensors
    batch = load_rollout(ROLLOUT)
    r, p = batch.response_width, batch.tensors["prompt_ids"].shape[1]
    wide = verl_tensors(batch, width=r + 3)
    assert wide["responses"].shape[1] == r + 3 and wide["input_ids"].shape[1] == p + r + 3
    assert not wide["response_mask"][:, r:].any()                   # padding, never trained on
    assert torch.equal(wide["responses"][:, :r], batch.tensors["response_ids"])
    # the attention mask covers exactly each row's prompt and response tokens
    lengths = batch.tensors["prompt_lengths"] + batch.tensors["response_lengths"]
    assert torch.equal(wide["attention_mask"].sum(1), lengths)
    back = to_batch_width(torch.ones(len(batch), r + 3), r)
    assert back.shape == (len(batch), r)
    longest = int(batch.tensors["response_lengths"].max())
    assert verl_tensors(batch, width=longest - 1)["responses"].shape[1] == r   # never cut a token


def test_rows_verl_refuses_to_cut():
    from rlaudit.targets.peers.verl_train import rows_unsupported
    cfg = load_config({"rollout": {"n": 4}, "actor": {"ppo_mini_batch_size": 2}})
    assert rows_unsupported(cfg, 16) == ""              # two mini-batches of 8 rows
    assert rows_unsupported(cfg, 4) == ""               # smaller than one: it is one
    assert "12 rows" in rows_unsupported(cfg, 12)       # 8 + 4: verl asserts whole ones
    assert "2 rank" in rows_unsupported(load_config({"rollout": {"n": 1}, "actor": {
        "ppo_mini_batch_size": 3}}), 3, dp=2)           # 3 rows over 2 ranks
