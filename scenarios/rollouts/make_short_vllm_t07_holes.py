"""Build ``short-vllm-t07-holes``: the vLLM rollout sampled at temperature 0.7
(``short-vllm-t07``) with masked holes punched inside four responses, as a tool's output in a
multi-turn rollout (context for later tokens, not trained on). Deterministic: re-running it
rewrites the same file (the sidecar's sha256 does not change).

    PYTHONPATH=. python scenarios/rollouts/make_short_vllm_t07_holes.py

Used by the TRL whole-trainer scenarios (scenarios/trl_*.yaml): the rows have uneven lengths
(2..12 tokens), prompts of three lengths (5, 7, 8: left padding in trainers that left-pad), and
the holes put response_mask False *inside* responses as well as after them.
"""

from pathlib import Path

import torch

from rlaudit.data.batch import RolloutBatch
from rlaudit.data.io import load_rollout, save_rollout

HERE = Path(__file__).resolve().parent
#: row -> response columns masked out (each row keeps trained tokens before and after its hole)
HOLES = {1: (1,), 7: (3, 4, 5), 10: (6, 7), 13: (2,)}


def main() -> None:
    src = load_rollout(HERE / "short-vllm-t07.safetensors")
    mask = src["response_mask"].clone()
    lengths = src["response_lengths"]
    for row, cols in HOLES.items():
        assert int(lengths[row]) > max(cols) + 1, (row, cols)
        mask[row, list(cols)] = False
    out = RolloutBatch.from_tensors({**src.tensors, "response_mask": mask}, kinds=src.kinds,
                                    meta=src.meta, source="make_short_vllm_t07_holes")
    save_rollout(out, HERE / "short-vllm-t07-holes.safetensors",
                 meta={"derived_from": "short-vllm-t07",
                       "holes": {str(k): list(v) for k, v in HOLES.items()},
                       "recipe": "PYTHONPATH=. python "
                                 "scenarios/rollouts/make_short_vllm_t07_holes.py"})


if __name__ == "__main__":
    main()
