"""The value_loss stage checks against hand-built critics: a naive per-token loop (itself checked on
hand-worked numbers) passes; a clip around the returns, a missing factor 1/2 and a per-micro-batch
normalisation are each caught by the check made for them."""

from __future__ import annotations

import pytest
import torch

from rlaudit.targets.stages import run_stage_checks
from rlaudit.verdict.result import FAIL, PASS


def naive_value_loss(vpreds, values, returns, mask, c, mode, denominators=None, *,
                     centre="values", half=0.5):
    """Python loops over rows and tokens (docs/internals.md's aggregation table)."""
    b, r = mask.shape
    per_row, row_tokens = [], []
    for i in range(b):
        terms = []
        for t in range(r):
            if not bool(mask[i, t]):
                continue
            v, g = vpreds[i, t], returns[i, t]
            mid = values[i, t] if centre == "values" else returns[i, t]
            clipped = torch.minimum(torch.maximum(v, mid - c), mid + c)
            terms.append(half * torch.maximum((v - g) ** 2, (clipped - g) ** 2))
        per_row.append(terms)
        row_tokens.append(len(terms))
    n_tok = denominators.tokens if denominators else sum(row_tokens)
    n_seq = denominators.seqs if denominators else sum(1 for n in row_tokens if n)
    width = denominators.norm_len if denominators and denominators.norm_len else r
    zero = vpreds.sum() * 0
    if mode == "token-mean":
        total = sum((x for row in per_row for x in row), zero)
        return total / n_tok if n_tok else zero
    sums = [sum(row, zero) / (len(row) if mode == "seq-mean-token-mean" else 1)
            for row in per_row if row]
    total = sum(sums, zero)
    if mode == "seq-mean-token-sum-norm":
        return total / (n_seq * width) if n_seq else zero
    return total / n_seq if n_seq else zero


class NaiveCritic:
    name = "naive-critic"
    precision = "float64"
    centre, half, global_counts = "values", 0.5, True

    def value_loss(self, *, vpreds, values, returns, response_mask, cliprange_value,
                   loss_agg_mode, denominators=None):
        loss = naive_value_loss(vpreds, values, returns, response_mask, cliprange_value,
                                loss_agg_mode, denominators if self.global_counts else None,
                                centre=self.centre, half=self.half)
        return loss, {}


class ClipsAroundReturns(NaiveCritic):
    name, centre = "clips-around-returns", "returns"


class NoHalf(NaiveCritic):
    name, half = "no-half", 1.0


class PerMicroBatchCritic(NaiveCritic):
    """verl before PR #6957: each micro-batch normalised by its own counts."""
    name, global_counts = "per-micro-batch-critic", False


def test_naive_critic_on_hand_worked_numbers():
    # c = 0.5, one row: per token 2, 1.125, 1.62, 1.125 (tests/algo/test_value_loss.py works
    # them out); the last token masked out
    v = torch.tensor([[2.0, 2.0, 1.2, -1.0]], dtype=torch.float64)
    old = torch.tensor([[1.0, 1.0, 1.0, 0.0]], dtype=torch.float64)
    ret = torch.tensor([[0.0, 3.0, 3.0, 0.5]], dtype=torch.float64)
    mask = torch.tensor([[True, True, True, False]])
    got = {m: float(naive_value_loss(v, old, ret, mask, 0.5, m)) for m in
           ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")}
    assert got == pytest.approx({"token-mean": 4.745 / 3, "seq-mean-token-sum": 4.745,
                                 "seq-mean-token-mean": 4.745 / 3,
                                 "seq-mean-token-sum-norm": 4.745 / 4}, abs=1e-12)


def _statuses(adapter):
    res = run_stage_checks(adapter, stages=["value_loss"])
    return {c.invariant: c for c in res.checks}


def test_a_correct_critic_passes():
    got = _statuses(NaiveCritic())
    for name in ("value_loss:parity", "value_loss:global-split", "value_loss:no-mutation"):
        assert got[name].status == PASS, (name, got[name].message)


@pytest.mark.parametrize("cls, fails, passes", [
    (ClipsAroundReturns, "value_loss:parity", "value_loss:global-split"),
    (NoHalf, "value_loss:parity", "value_loss:global-split"),
    (PerMicroBatchCritic, "value_loss:global-split", "value_loss:parity"),
])
def test_each_bug_is_caught_by_its_check(cls, fails, passes):
    got = _statuses(cls())
    assert got[fails].status == FAIL, got[fails].message
    assert got[passes].status == PASS, got[passes].message
