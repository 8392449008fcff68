"""Build ``short-ref-rewards``: the ``short-ref`` rollout scored by two reward functions with
unequal weights (rlaudit/data/rewards.py). Deterministic: re-running it rewrites the same files.

    PYTHONPATH=. python scenarios/rollouts/make_reward_functions.py

- ``task`` (weight 1.0): the recorded rule score of the ``short`` task;
- ``brevity`` (weight 0.5): ``1 - response_length / max_new_tokens``, a length bonus given only
  to responses whose task score is at least 0.9 -- the others are not scored by it (TRL: the
  function returns None there; ``reward_mask`` False): its mean is over the 10 rows it scored,
  and the combined score of the other 6 is their task score alone.

``scores`` is their weighted sum over the functions that scored each row. Within a group the two
functions rank rows differently, so a trainer that sums them unweighted, or drops one, trains on
other advantages and logs another ``critic/score/mean`` (used by trl_reward_weights).
"""

from pathlib import Path

import torch

from rlaudit.data import rewards
from rlaudit.data.batch import RolloutBatch
from rlaudit.data.io import load_rollout, save_rollout

HERE = Path(__file__).resolve().parent
RECIPE = "PYTHONPATH=. python scenarios/rollouts/make_reward_functions.py"
SOURCE = "short-ref"
NAME = "short-ref-rewards"
FUNCTIONS = ["task", "brevity"]
WEIGHTS = [1.0, 0.5]
#: the task score from which the brevity bonus applies
BONUS_FROM = 0.9


def derive(out_dir: Path = HERE) -> Path:
    """Write ``short-ref-rewards`` into ``out_dir``; returns the safetensors path."""
    src = load_rollout(HERE / f"{SOURCE}.safetensors")
    width = int(src.meta["sampling"]["max_new_tokens"])
    brevity = 1.0 - src["response_lengths"].float() / width
    task = src["scores"].float()
    per_function = torch.stack([task, brevity], 1)
    applied = torch.stack([torch.ones_like(task, dtype=torch.bool), task >= BONUS_FROM], 1)
    meta = {**src.meta, rewards.NAMES: FUNCTIONS, rewards.WEIGHTS: WEIGHTS}
    tensors = {**src.tensors, rewards.SCORES: per_function, rewards.MASK: applied}
    tensors.pop("scores")
    tensors = rewards.with_combined_scores(tensors, meta, source="make_reward_functions")
    out = RolloutBatch.from_tensors(tensors, kinds=src.kinds, meta=meta,
                                    source="make_reward_functions")
    path = out_dir / f"{NAME}.safetensors"
    save_rollout(out, path, meta={"derived_from": SOURCE, "recipe": RECIPE})
    return path


if __name__ == "__main__":
    derive()
