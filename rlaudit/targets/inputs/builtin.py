"""The built-in target scenario: what ``rlaudit run --target X`` replays when no scenario is
named — the committed tiny Qwen2 snapshot and a small rollout sampled from it on the spot.

The reference policy (for KL terms) is the tiny Llama snapshot (same tokenizer), so KL is far from
0. The rollout is deterministic (reference sampler, fixed seed) and has the edge cases a trainer
must handle: ragged response lengths including 0 and 1 (responses are cut after sampling; a cut
keeps the sampling log-probs of the kept tokens exact), masked holes inside two responses (tool
output of a multi-turn rollout: context, not trained on), groups of 4 rows, scores with non-zero
spread inside each group, sampled at temperature 0.7 (a trainer that forgets to divide its logits
by the rollout temperature, or divides twice, disagrees with the sampler's log-probs). Config:
GRPO, fp64, SGD, DAPO's asymmetric clip, entropy computed and logged with coefficient 0, two
mini-batches x two PPO epochs (four optimizer steps) per training step, two training steps.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from rlaudit.config import Config, load_config
from rlaudit.data.batch import RolloutBatch
from rlaudit.scenarios.spec import Scenario
from rlaudit.verdict.tolerance import Tolerance
from rlaudit.model.tiny import save_snapshot
from rlaudit.model.load import load_model
from rlaudit.rollout.sampler import sample
from rlaudit.scenarios.invariants import INVARIANTS

PROMPTS = 2          # groups
N = 4                # rows per group
MAX_NEW_TOKENS = 6   # R
#: response lengths after cutting (row order = sampler order: prompt-major)
CUT_LENGTHS = (6, 3, 1, 5, 0, 6, 2, 4)
#: response positions with response_mask False inside a response (row -> columns), as a tool's
#: output in a multi-turn rollout: in the context of later tokens, not trained on
MASK_HOLES = {0: (2, 3), 7: (1,)}
SEED = 0
#: rollout temperature (not 1: the log-probs a trainer recomputes must apply it)
TEMPERATURE = 0.7
#: invariants not run against targets: nested-matches-padded is a stage check here
SKIPPED_INVARIANTS = ("nested-matches-padded",)
#: A third-party trainer usually runs stock Hugging Face models, whose float64 mode keeps RoPE,
#: RMSNorm's variance and the attention softmax in float32 (rlaudit's own backends do not: see
#: rlaudit/model/exact.py), so the same row in another batch composition (micro-batch size,
#: padding, row order, another layout) moves by ~1e-7 relative; the bugs these invariants exist
#: for move results by 1e-3 and more.
TOLERANCE = Tolerance(rtol=1e-5, atol=1e-6)

CONFIG = {
    "algorithm": {"adv_estimator": "grpo"},
    "actor": {"optim": {"name": "sgd", "lr": 0.5}, "ppo_mini_batch_size": 1,
              "ppo_micro_batch_size_per_gpu": 2, "entropy_coeff": 0.0,
              "calculate_entropy": True, "clip_ratio_low": 0.2, "clip_ratio_high": 0.28,
              "grad_clip": 1.0, "ppo_epochs": 2},
    "rollout": {"n": N, "response_length": MAX_NEW_TOKENS, "temperature": TEMPERATURE},
    "data": {"train_batch_size": PROMPTS},
    "trainer": {"dtype": "float64", "seed": SEED},
}


def tiny_model_path(scenarios_dir: str | Path | None = None, arch: str = "qwen2") -> Path:
    """``<scenarios_dir>/models/<arch>-tiny`` if it exists, else the repository's copy, else a
    snapshot built (deterministically, no download) into ``~/.cache/rlaudit``."""
    rel = Path("models") / f"{arch}-tiny"
    candidates = []
    if scenarios_dir is not None:
        candidates.append(Path(scenarios_dir) / rel)
    candidates.append(Path(__file__).resolve().parents[3] / "scenarios" / rel)
    for c in candidates:
        if (c / "config.json").is_file():
            return c.resolve()
    out = Path.home() / ".cache" / "rlaudit" / f"{arch}-tiny"
    if not (out / "config.json").is_file():
        save_snapshot(out, arch)
    return out


def config() -> Config:
    return load_config(CONFIG, source="rlaudit.targets.inputs.builtin")


@functools.lru_cache(maxsize=2)
def _sampled(model_path: str) -> RolloutBatch:
    model = load_model(model_path, dtype=torch.float64)
    g = torch.Generator().manual_seed(SEED)
    vocab = 256  # byte tokens only (ids above are special tokens of the tiny tokenizer)
    prompts = [torch.randint(0, vocab, (int(n),), generator=g).tolist() for n in (5, 3)]
    return sample(model, prompts, n=N, max_new_tokens=MAX_NEW_TOKENS, seed=SEED,
                  temperature=TEMPERATURE)


def rollout(model_path: str | Path) -> RolloutBatch:
    """The built-in rollout (B = 8, R = 6): sampled, cut to :data:`CUT_LENGTHS`, scored."""
    batch = _sampled(str(model_path))
    lengths = torch.minimum(torch.tensor(CUT_LENGTHS), batch["response_lengths"])
    in_response = torch.arange(batch.response_width).unsqueeze(0) < lengths.unsqueeze(1)
    pad = int(batch.meta.get("pad_token_id", 0))
    response_ids = torch.where(in_response, batch["response_ids"], pad)
    rollout_lp = torch.where(in_response, batch["rollout_log_probs"], 0.0)
    # tokens inside a response that are not trained on (a tool's output in a multi-turn rollout):
    # they stay in the context of later tokens, the score still goes on the last response token
    mask = in_response.clone()
    for row, cols in MASK_HOLES.items():
        if int(lengths[row]) > max(cols) + 1:
            mask[row, list(cols)] = False
    # rule score: share of a response's tokens below 128 (0 for an empty response)
    low = torch.where(in_response, (response_ids < 128).double(), 0.0).sum(1)
    scores = low / lengths.clamp(min=1).double()
    return RolloutBatch.from_tensors(
        {**batch.tensors, "response_ids": response_ids, "response_lengths": lengths,
         "response_mask": mask, "rollout_log_probs": rollout_lp, "scores": scores},
        meta=batch.meta, source="rlaudit.targets.inputs.builtin.rollout")


def scenario(model_path: str | Path, invariants: list[str] | None = None, *,
             ref_model_path: str | Path | None = None) -> Scenario:
    """The built-in scenario (its ``rollout`` path is a placeholder: use :func:`rollout`). The
    reference policy is the tiny Llama (same tokenizer), so KL terms are far from 0."""
    ref = Path(ref_model_path) if ref_model_path else tiny_model_path(Path(model_path).parents[1],
                                                                      "llama")
    names = invariants or [n for n in INVARIANTS if n not in SKIPPED_INVARIANTS]
    return Scenario(name="target-builtin", path=Path("<built-in target scenario>"),
                    description="tiny Qwen2, sampled rollout (B=8, R=6), GRPO, fp64, SGD",
                    model=Path(model_path), ref_model=ref, rollout=Path("<sampled>"),
                    config=config(),
                    backends={"reference": {}}, invariants=names, steps=2, dtype="float64",
                    tolerances={"default": TOLERANCE}, tags=["target"])
