"""place_scores and KL-in-reward: hand numbers, out-of-place construction (slime PR #2114)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from rlaudit.algo.reward import apply_kl_in_reward, kl_in_reward_metrics, place_scores
from rlaudit.errors import InputError, UnknownNameError

F64 = torch.float64


def test_place_scores_hand_worked():
    out = place_scores(torch.tensor([1.5, -2.0, 7.0, 3.0], dtype=F64),
                       torch.tensor([2, 4, 0, 1]), 4)
    expect = torch.tensor([[0, 1.5, 0, 0], [0, 0, 0, -2], [0, 0, 0, 0], [3, 0, 0, 0]], dtype=F64)
    assert torch.equal(out, expect)           # the length-0 row's score (7) is dropped
    assert out.dtype == F64


@given(lens=st.lists(st.integers(0, 6), min_size=1, max_size=6))
def test_place_scores_naive(lens):
    scores = torch.arange(1, len(lens) + 1, dtype=torch.float32) * 1.25
    out = place_scores(scores, torch.tensor(lens), 6)
    for i, n in enumerate(lens):
        for t in range(6):
            assert out[i, t].item() == (scores[i].item() if t == n - 1 else 0.0)


def test_place_scores_bad_inputs():
    with pytest.raises(InputError, match="response_lengths.*\\[0, width=3\\]"):
        place_scores(torch.zeros(2), torch.tensor([1, 4]), 3)
    with pytest.raises(InputError, match="response_lengths"):
        place_scores(torch.zeros(2), torch.tensor([1.0, 2.0]), 3)
    with pytest.raises(InputError, match="scores"):
        place_scores(torch.zeros(2, 1), torch.tensor([1, 2]), 3)


def _batch():
    scores = torch.tensor([[0, 0, 1.0], [0, 2.0, 0]], dtype=F64)
    old = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -0.7, float("nan")]], dtype=F64)
    ref = torch.tensor([[-1.5, -1.0, -0.5], [-0.3, -1.7, float("inf")]], dtype=F64)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.bool)
    return scores, old, ref, mask


def test_kl_in_reward_hand_worked_k1_and_k2():
    scores, old, ref, mask = _batch()
    rewards, kl = apply_kl_in_reward(scores, old, ref, mask, kl_coef=0.1, kl_penalty="k1")
    expect_kl = torch.tensor([[0.5, -1.0, 0.0], [0.0, 1.0, 0.0]], dtype=F64)
    assert torch.allclose(kl, expect_kl, atol=1e-15, rtol=0)
    assert torch.allclose(rewards, scores - 0.1 * expect_kl, atol=1e-15, rtol=0)
    rewards, kl = apply_kl_in_reward(scores, old, ref, mask, kl_coef=0.5, kl_penalty="mse")
    expect_kl = torch.tensor([[0.125, 0.5, 0.0], [0.0, 0.5, 0.0]], dtype=F64)
    assert torch.allclose(kl, expect_kl, atol=1e-15, rtol=0)
    assert torch.allclose(rewards, torch.tensor([[-0.0625, -0.25, 1.0], [0, 1.75, 0]], dtype=F64),
                          atol=1e-15, rtol=0)


def test_kl_in_reward_k3_naive():
    scores, old, ref, mask = _batch()
    _, kl = apply_kl_in_reward(scores, old, ref, mask, kl_coef=1.0, kl_penalty="low_var_kl")
    for i in range(2):
        for t in range(3):
            d = ref[i, t].item() - old[i, t].item()
            want = math.exp(d) - d - 1 if mask[i, t] else 0.0
            assert kl[i, t].item() == pytest.approx(want, abs=1e-14)


@pytest.mark.parametrize("kind", ["k1", "abs", "k2", "k3", "low_var_kl+"])
def test_out_of_place_no_alias_no_mutation(kind):
    scores, old, ref, mask = _batch()
    ins = [scores, old, ref, mask]
    before = [(t.clone(), t._version) for t in ins]
    rewards, kl = apply_kl_in_reward(scores, old, ref, mask, kl_coef=0.05, kl_penalty=kind)
    kl_copy = kl.clone()
    for t, (copy, ver) in zip(ins, before):
        assert torch.allclose(t.double(), copy.double(), atol=0, rtol=0, equal_nan=True)
        assert t._version == ver
    ptrs = {t.untyped_storage().data_ptr() for t in ins}
    assert kl.untyped_storage().data_ptr() not in ptrs
    assert rewards.untyped_storage().data_ptr() not in ptrs | {kl.untyped_storage().data_ptr()}
    # the seed bug: shaping the rewards further in place must not change the stored KL
    rewards.mul_(3.0).add_(1.0)
    assert torch.equal(kl, kl_copy)
    assert not rewards.isnan().any() and not kl.isnan().any()   # NaN under mask 0 did not leak


def test_metrics_and_zero_coef():
    scores, old, ref, mask = _batch()
    rewards, kl = apply_kl_in_reward(scores, old, ref, mask, kl_coef=0.0, kl_penalty="k1")
    assert torch.equal(rewards, scores)
    got = kl_in_reward_metrics(kl, mask, kl_coef=0.2)
    assert got["rollout/kl"] == pytest.approx((0.5 - 1.0 + 0.0 + 0.0 + 1.0) / 5, abs=1e-15)
    assert got["actor/reward_kl_penalty"] == pytest.approx(0.2 * 0.5 / 5, abs=1e-15)
    empty = kl_in_reward_metrics(kl, torch.zeros_like(mask), kl_coef=0.2)
    assert empty == {"rollout/kl": 0.0, "actor/reward_kl_penalty": 0.0}


def test_kl_in_reward_bad_inputs():
    scores, old, ref, mask = _batch()
    with pytest.raises(UnknownNameError):
        apply_kl_in_reward(scores, old, ref, mask, kl_coef=0.1, kl_penalty="k9")
    with pytest.raises(InputError, match="ref_log_probs"):
        apply_kl_in_reward(scores, old, ref[:, :2], mask, kl_coef=0.1, kl_penalty="k1")
    with pytest.raises(InputError, match="mask"):
        apply_kl_in_reward(scores, old, ref, mask[:1], kl_coef=0.1, kl_penalty="k1")
