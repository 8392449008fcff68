"""Inputs for the Megatron backend tests: a small sampled rollout, the variants every layout
replays, and a rank function that replays several requests in one spawned group (spawning costs seconds).

The rollout: 2 prompts x 4 responses sampled from the committed tiny Qwen2 (float64, reference
sampler), responses cut to ragged lengths including 0 and 1, a rule score per row. The reference
policy is the committed tiny Llama (same tokenizer), so KL terms are far from 0 and every layout
also runs a Llama GPTModel (no QKV bias) forward.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch

from rlaudit.backends.base import ReplayRequest, Variant
from rlaudit.config import load_config
from rlaudit.data.batch import RolloutBatch

REPO = Path(__file__).resolve().parents[3]
MODEL = REPO / "scenarios" / "models" / "qwen2-tiny"
REF_MODEL = REPO / "scenarios" / "models" / "llama-tiny"

PROMPT_LENGTHS = (5, 3)
N = 4
MAX_NEW_TOKENS = 6
CUT_LENGTHS = (6, 3, 1, 5, 0, 6, 2, 4)   # ragged, incl. an empty and a one-token response
TOPK = 3
SEED = 0

BASE = {
    "algorithm": {"adv_estimator": "grpo"},
    "actor": {"optim": {"name": "sgd", "lr": 0.5}, "ppo_mini_batch_size": 1,
              "ppo_micro_batch_size_per_gpu": 2, "entropy_coeff": 0.0,
              "calculate_entropy": True, "clip_ratio_low": 0.2, "clip_ratio_high": 0.28,
              "grad_clip": 1.0},
    "rollout": {"n": N, "response_length": MAX_NEW_TOKENS},
    "data": {"train_batch_size": len(PROMPT_LENGTHS)},
    "trainer": {"dtype": "float64", "seed": SEED},
}

#: variant name -> (dotted overrides of BASE, training steps). Each exercises one path of the
#: shared step through megatron: entropy computed with coefficient 0 (SEEDS.md §1) or not, as a
#: loss term, KL loss against the Llama reference, every loss_agg_mode, micro-batch size 1 vs the
#: whole mini-batch, token-budget micro-batches, padding micro-batches, AdamW, clipping off/active,
#: rollout correction, KL in the reward, top-k distillation, and a critic (unsupported).
VARIANTS = {
    "base": ({}, 2),
    "entropy-off": ({"actor.calculate_entropy": False}, 1),
    "entropy-coef": ({"actor.entropy_coeff": 0.01, "actor.calculate_entropy": False}, 1),
    "kl-loss": ({"actor.use_kl_loss": True, "actor.kl_loss_coef": 0.1}, 1),
    "seq-mean-token-sum": ({"actor.loss_agg_mode": "seq-mean-token-sum"}, 1),
    "seq-mean-token-mean": ({"actor.loss_agg_mode": "seq-mean-token-mean"}, 1),
    "seq-mean-token-sum-norm": ({"actor.loss_agg_mode": "seq-mean-token-sum-norm"}, 1),
    "micro-1": ({"actor.ppo_micro_batch_size_per_gpu": 1}, 1),
    "micro-all": ({"actor.ppo_mini_batch_size": 2, "actor.ppo_micro_batch_size_per_gpu": 8}, 1),
    "dynamic-bsz": ({"actor.use_dynamic_bsz": True, "actor.ppo_max_token_len_per_gpu": 16}, 1),
    "padding": ({"trainer.extra_padding_microbatches": 2}, 1),
    "adamw": ({"actor.optim": {"name": "adamw", "lr": 1e-3, "weight_decay": 0.1}}, 2),
    "no-clip": ({"actor.grad_clip": 0.0}, 1),
    "clip-active": ({"actor.grad_clip": 0.05}, 1),
    "rollout-corr": ({"actor.rollout_correction": {"rollout_is": "token",
                                                   "use_rollout_kl_loss": True,
                                                   "rollout_kl_loss_coef": 0.1}}, 1),
    "kl-in-reward": ({"algorithm.use_kl_in_reward": True, "algorithm.kl_coef": 0.1}, 1),
    "distill-topk": ({"actor.distill": {"enable": True, "loss_type": "forward_kl_topk",
                                        "coef": 0.5}}, 1),
    "gae": ({"algorithm.adv_estimator": "gae"}, 1),
}


def rollout() -> RolloutBatch:
    """B = 8 rows, R = 6: sampled, cut to CUT_LENGTHS, scored; plus a synthetic teacher top-k
    (ids and normalised-looking log-probs) for the distillation variant."""
    from rlaudit.model.load import load_model
    from rlaudit.rollout.sampler import sample

    model = load_model(MODEL, dtype=torch.float64)
    g = torch.Generator().manual_seed(SEED)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]
    batch = sample(model, prompts, n=N, max_new_tokens=MAX_NEW_TOKENS, seed=SEED)
    lengths = torch.minimum(torch.tensor(CUT_LENGTHS), batch["response_lengths"])
    mask = torch.arange(batch.response_width).unsqueeze(0) < lengths.unsqueeze(1)
    pad = int(batch.meta.get("pad_token_id", 0))
    response_ids = torch.where(mask, batch["response_ids"], pad)
    low = torch.where(mask, (response_ids < 128).double(), 0.0).sum(1)
    b, r = mask.shape
    teacher_ids = torch.randint(0, 264, (b, r, TOPK), generator=g)
    teacher_lp = torch.log_softmax(torch.randn(b, r, TOPK + 1, generator=g,
                                               dtype=torch.float64), -1)[..., :TOPK]
    return RolloutBatch.from_tensors(
        {**batch.tensors, "response_ids": response_ids, "response_lengths": lengths,
         "response_mask": mask,
         "rollout_log_probs": torch.where(mask, batch["rollout_log_probs"], 0.0),
         "scores": low / lengths.clamp(min=1).double(),
         "teacher_topk_ids": teacher_ids, "teacher_topk_log_probs": teacher_lp},
        meta=batch.meta, source="megatron_backend_ranks.rollout")


def _config(overrides: dict, dtype: str):
    data = copy.deepcopy(BASE)
    data["trainer"] = {**data["trainer"], "dtype": dtype}
    for key, value in overrides.items():
        section, name = key.split(".", 1)
        node = data.setdefault(section, {})
        parts = name.split(".")
        for p in parts[:-1]:
            node = node.setdefault(p, {})
        node[parts[-1]] = value
    return load_config(data, source="megatron_backend_ranks")


def variants(batch: RolloutBatch, names=None, *, dtype: str = "float64") -> list[Variant]:
    return [Variant(name=n, config=_config(VARIANTS[n][0], dtype), batch=batch,
                    steps=VARIANTS[n][1]) for n in (names or VARIANTS)]


def request(batch: RolloutBatch, layout: dict, names=None, *, dtype: str = "float64",
            model: Path = MODEL, ref_model: Path = REF_MODEL,
            timeout: float = 900.0) -> ReplayRequest:
    return ReplayRequest(model=str(model), ref_model=str(ref_model),
                         variants=variants(batch, names, dtype=dtype), layout=layout,
                         dtype=dtype, timeout=timeout)


def replay_many(info, requests: list[ReplayRequest]) -> dict:
    """Rank function: replay each request in turn in this one group (same world size for all)."""
    import time

    from rlaudit.backends.megatron.backend import replay_in_rank

    out, seconds = [], []
    for req in requests:
        t0 = time.perf_counter()
        out.append(replay_in_rank(info, req))
        seconds.append(time.perf_counter() - t0)
    return {"runs": out, "seconds": seconds}
