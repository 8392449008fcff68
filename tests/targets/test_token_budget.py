"""make_microbatches:within-token-budget holds both bounds, on hand-worked cuts.

Three rows of 3 prompt + 3 response tokens (6 each, 18 in all) under a budget of 10 tokens per
micro-batch, one rank: no two rows fit together (12 > 10), so a correct cutter gives three
micro-batches of one row. A cutter that takes ceil(18 / 10) = 2 micro-batches and spreads the
rows over them (verl before PR #7553) puts two rows, 12 tokens, into one: over the budget. One
that packs all three rows into one micro-batch (18 tokens) also breaks the lower bound (1 < 2).

Under the declared convention ``token_budget: response`` a row counts its 3 response tokens
only: all three rows (9 tokens) fit a budget of 10 in one micro-batch; under a budget of 5 two
rows (6 tokens) do not.
"""

from __future__ import annotations

import torch

import pytest

import broken_adapters as broken
from rlaudit.data.batch import RolloutBatch
from rlaudit.targets import Difference
from rlaudit.targets.stages import StageEnv, run_stage_checks, stage_checks
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

    def __init__(self, groups: list[list[int]], budget: int = BUDGET,
                 counts: str | None = None):
        self.groups, self.budget = groups, budget
        if counts is not None:
            self.differences = (response_only(counts),)

    def make_microbatches(self, batch, *, dp_size, micro_batch_size=None, max_token_len=None):
        assert dp_size == 1 and max_token_len == self.budget
        return [[batch.select(torch.tensor(g)) for g in self.groups]]


def response_only(counts: str = "response") -> Difference:
    return Difference("budget-counts-response", "the token budget counts response tokens only",
                      "https://example.org/budget", checks=(CHECK,),
                      convention={"token_budget": counts})


def check(groups: list[list[int]], budget: int = BUDGET, counts: str | None = None):
    env = StageEnv(Cutter(groups, budget, counts),
                   overrides={"microbatch_inputs": [three_rows()],
                              "layouts": [(1, None, budget, 0)]})
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


def test_declared_prompt_and_response_is_the_default():
    res = check([[0, 1], [2]], counts="prompt+response")
    assert res.status == FAIL and "holds 12 tokens (prompt + response" in res.message


def test_response_only_all_three_rows_fit_a_budget_of_ten():
    res = check([[0, 1, 2]], counts="response")
    assert res.status == PASS, res.message
    assert "response tokens" in res.message


def test_response_only_two_rows_overfill_a_budget_of_five():
    res = check([[0, 1], [2]], budget=5, counts="response")
    assert res.status == FAIL
    assert "holds 6 tokens (response of 2 rows: [3, 3])" in res.message, res.message
    assert "budget of 5" in res.message
    # 9 response tokens under 5: at least 2 micro-batches; one is too few
    res = check([[0, 1, 2]], budget=5, counts="response")
    assert "at least 2 needed" in res.message and "prompt tokens" not in res.message


def test_a_convention_value_the_reference_cannot_compute_is_bad_input():
    from rlaudit.errors import InputError
    from rlaudit.targets.contract.declare import read_declarations
    adapter = Cutter([[0]], counts="prompt-only")
    with pytest.raises(InputError, match="prompt-only"):
        read_declarations(adapter)


class BudgetCountsResponse(broken.BudgetWithoutPrompt):
    """The same cutter, its budget declared as counting response tokens only."""

    name = "budget-counts-response"
    differences = (response_only(),)


@pytest.mark.parametrize("cls, want", [(broken.BudgetWithoutPrompt, FAIL),
                                       (BudgetCountsResponse, PASS)], ids=["undeclared",
                                                                           "declared"])
def test_a_response_only_budget_is_red_undeclared_and_green_declared(cls, want):
    """A cutter that budgets response tokens only overflows the prompt + response budget on the
    default inputs; declared as its convention, the check runs under it and passes (the other
    micro-batching checks are unaffected either way)."""
    res = run_stage_checks(cls(), stages=["make_microbatches"])
    checks = {c.invariant: c for c in res.checks}
    assert checks[CHECK].status == want, checks[CHECK].message
    assert all(c.status == PASS for n, c in checks.items() if n != CHECK), {
        n: c.message for n, c in checks.items() if c.status != PASS}
