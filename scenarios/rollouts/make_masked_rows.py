"""Build the rollouts derived from recorded ones by editing the mask or a score: where a real
trainer's data differs from a freshly sampled batch. Deterministic: re-running it rewrites the same
files (the sidecars' sha256 do not change).

    PYTHONPATH=. python scenarios/rollouts/make_masked_rows.py

``short-vllm-t07-holes`` (from ``short-vllm-t07``, 4 x 4): holes punched inside four responses,
as a tool's output in a multi-turn rollout (context for later tokens, not trained on). Used by
the TRL whole-trainer scenarios (scenarios/trl_*.yaml): uneven rows (2..12 tokens), prompts of
three lengths (5, 7, 8: left padding in trainers that left-pad), and response_mask False
*inside* responses as well as after them.

``short-ref-masked`` (from ``short-ref``, 4 x 4): row 13, the one response that hit the length
limit (12 tokens), is masked out of the loss whole -- DAPO's overlong filtering, which keeps the
row (its score still counts in its group) but trains on none of its tokens -- and rows 5 and 9
get holes. A mini-batch of 8 rows sharded over two data-parallel ranks then gives one rank a row
without a trained token and the other none: a per-sequence denominator must count the rows of
every rank, not its own times the rank count (used by agg_seq_mean_token_mean).

``short-dapo-holes`` (from ``short-dapo``, 8 x 4): row 28, the over-long one (12 tokens, inside
the overlong buffer's 4), gets a hole of 3 tokens, so its length is not its count of trained
tokens (the overlong penalty is a function of the length); and its score is set to that of the
other three rows of its group (0.8333): the group's scores then have no spread and only the
overlong penalty spreads its rewards -- dynamic sampling on ``seq_reward`` keeps it, on the raw
score it would drop it (used by dapo_filter_overlong).

``short-ref-scattered`` (from ``short-ref``, 4 x 4): the same rows in another order, the groups'
rows interleaved (row i is source row 4 * (i % 4) + i // 4): every mini-batch of 8 rows holds
half of each group, and one of its two mini-batches holds no response at the length limit. A
trainer that takes group statistics, or the longest response, within a mini-batch instead of the
batch then computes otherwise; with groups stored contiguously, as every recorded rollout has
them, each mini-batch holds whole groups and it does not (a blind audit; used by
agg_seq_sum_norm_scattered).

``short-stale-holes`` (from ``short-stale``, 4 x 4): holes inside five responses of the
off-policy rollout, so a sequence-level or geometric importance weight summed over a response's
generated tokens (holes included) is not the one over its trained tokens (a blind audit: summing
over the attention mask passed --all, no IS scenario having holes; used by rollout_is_stale_mask).
"""

from pathlib import Path

import torch

from rlaudit.data.batch import RolloutBatch
from rlaudit.data.io import load_rollout, save_rollout

HERE = Path(__file__).resolve().parent
RECIPE = "PYTHONPATH=. python scenarios/rollouts/make_masked_rows.py"

#: name -> (source, {row: response columns masked out; None: the whole row},
#:          {row: the row whose score it takes}, row order: new row i is source row order[i]
#:          (None: the source's))
EDITS = {
    "short-vllm-t07-holes": ("short-vllm-t07", {1: (1,), 7: (3, 4, 5), 10: (6, 7), 13: (2,)}, {},
                             None),
    "short-ref-masked": ("short-ref", {13: None, 5: (1,), 9: (2, 3)}, {}, None),
    "short-dapo-holes": ("short-dapo", {28: (3, 4, 5)}, {28: 29}, None),
    "short-stale-holes": ("short-stale", {4: (2, 3), 7: (1,), 11: (4, 5, 6), 13: (3,),
                                          14: (8,)}, {}, None),
    "short-ref-scattered": ("short-ref", {}, {}, [4 * (i % 4) + i // 4 for i in range(16)]),
}


def derive(name: str, out_dir: Path = HERE) -> Path:
    """Write ``name`` (safetensors + sidecar) into ``out_dir``; returns the safetensors path."""
    source, holes, scores_from, order = EDITS[name]
    src = load_rollout(HERE / f"{source}.safetensors")
    mask = src["response_mask"].clone()
    lengths = src["response_lengths"]
    for row, cols in holes.items():
        if cols is None:
            mask[row] = False
            continue
        # each hole keeps trained tokens before and after it
        assert 0 < min(cols) and int(lengths[row]) > max(cols) + 1, (name, row, cols)
        mask[row, list(cols)] = False
    scores = src["scores"].clone()
    for row, other in scores_from.items():
        scores[row] = scores[other]
    tensors = {**src.tensors, "response_mask": mask, "scores": scores}
    if order is not None:
        tensors = {k: v[torch.tensor(order)] for k, v in tensors.items()}
    out = RolloutBatch.from_tensors(tensors, kinds=src.kinds, meta=src.meta,
                                    source="make_masked_rows")
    path = out_dir / f"{name}.safetensors"
    save_rollout(out, path, meta={
        "derived_from": source,
        "masked": {str(k): ("whole row" if v is None else list(v)) for k, v in holes.items()},
        "scores": {str(k): f"score of row {o}" for k, o in scores_from.items()},
        **({} if order is None else {"row_order": list(order)}), "recipe": RECIPE})
    return path


def main() -> None:
    for name in EDITS:
        derive(name)


if __name__ == "__main__":
    main()
