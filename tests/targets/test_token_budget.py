"""make_microbatches:within-token-budget holds both bounds, on hand-worked cuts.

Three rows of 3 prompt + 3 response tokens (6 each, 18 in all) under a budget of 10 tokens per
micro-batch, one rank: no two rows fit together (12 > 10), so a correct cutter gives three
micro-batches of one row. A cutter that takes ceil(18 / 10) = 2 micro-batches and spreads the
rows over them (verl before PR #7553) puts two rows, 12 tokens, into one: over the budget. One
that packs all three rows into one micro-batch (18 tokens) also breaks the lower bound (1 < 2).
"""

from __future__ import annotations

import torch

from rlaudit.data.batch import RolloutBatch
from rlaudit.targets.stages import StageEnv, stage_checks
from rlaudit.verdict.result import FAIL, PASS

BUDGET = 10
CHECK = "make_microbatches:within-token-budget"


def three_rows() -> RolloutBatch:
    rows = 3
    return RolloutBatch.from_tensors({
        "prompt_ids": 100 + torch.arange(rows).unsqueeze(1) + torch.zeros(rows, 3, dtype=torch.long),
        "prompt_lengths": torch.full((rows,), 3),
        "response_ids": torch.ones(rows, 3, dtype=torch.long),
        "response_lengths": torch.full((rows,), 3),
        "response_mask": torch.ones(rows, 3, dtype=torch.bool),
        "uid": torch.arange(rows),
    }, source="test")


class Cutter:
    """One rank; micro-batches as the given lists of row indices (whatever the budget says)."""

    name = "cutter"

    def __init__(self, groups: list[list[int]]):
        self.groups = groups

    def make_microbatches(self, batch, *, dp_size, micro_batch_size=None, max_token_len=None):
        assert dp_size == 1 and max_token_len == BUDGET
        return [[batch.select(torch.tensor(g)) for g in self.groups]]


def check(groups: list[list[int]]):
    env = StageEnv(Cutter(groups), overrides={"microbatch_inputs": [three_rows()],
                                              "layouts": [(1, None, BUDGET, 0)]})
    return stage_checks()[CHECK].fn(env)


def test_one_row_per_micro_batch_is_within_the_budget():
    res = check([[0], [1], [2]])
    assert res.status == PASS, res.message


def test_two_rows_of_six_in_one_micro_batch_overfill_a_budget_of_ten():
    res = check([[0, 1], [2]])
    assert res.status == FAIL
    assert "micro-batch 0 holds 12 tokens" in res.message and "budget of 10" in res.message
    assert "at least" not in res.message           # two micro-batches meet the lower bound


def test_everything_in_one_micro_batch_breaks_both_bounds():
    res = check([[0, 1, 2]])
    assert res.status == FAIL
    assert "holds 18 tokens" in res.message and "at least 2 needed" in res.message
