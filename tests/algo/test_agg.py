"""Loss aggregation against naive loops; the split property with global denominators."""

from __future__ import annotations

import functools
import math
import operator

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from rlaudit.algo.agg import (AGG_MODES, Denominators, agg_loss, masked_max, masked_mean,
                              masked_min, masked_sum)
from rlaudit.errors import InputError, UnknownNameError

F64 = torch.float64
MODES = ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]


def naive_agg(loss, mask, mode, norm_len=None):
    """Python loops over rows and tokens; the docs/internals.md table, written out."""
    rows = [[float(loss[i, t]) for t in range(loss.shape[1]) if mask[i, t]]
            for i in range(loss.shape[0])]
    n_tok = sum(len(r) for r in rows)
    n_seq = sum(1 for r in rows if r)
    L = loss.shape[1] if norm_len is None else norm_len
    if mode == "token-mean":
        return sum(sum(r) for r in rows) / n_tok if n_tok else 0.0
    if mode == "seq-mean-token-sum":
        return sum(sum(r) for r in rows) / n_seq if n_seq else 0.0
    if mode == "seq-mean-token-mean":
        return sum(sum(r) / len(r) for r in rows if r) / n_seq if n_seq else 0.0
    if mode == "seq-mean-token-sum-norm":
        return sum(sum(r) for r in rows) / (n_seq * L) if n_seq else 0.0
    raise AssertionError(mode)


def rand_batch(b, r, seed, p_valid=0.6):
    g = torch.Generator().manual_seed(seed)
    loss = torch.randn(b, r, generator=g, dtype=F64)
    mask = torch.rand(b, r, generator=g) < p_valid
    return loss, mask


def test_registry_names():
    assert AGG_MODES.names() == sorted(MODES)
    with pytest.raises(UnknownNameError, match="token-mean"):
        agg_loss(torch.zeros(1, 1), torch.ones(1, 1), "token-sum")


def test_hand_worked():
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]], dtype=F64)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0]])   # 0/1 ints; row 2 empty
    # tokens: 1,2 | 4  -> N_tok = 3, N_seq = 2, L = 3
    assert agg_loss(loss, mask, "token-mean").item() == pytest.approx(7 / 3)
    assert agg_loss(loss, mask, "seq-mean-token-sum").item() == pytest.approx((3 + 4) / 2)
    assert agg_loss(loss, mask, "seq-mean-token-mean").item() == pytest.approx((1.5 + 4) / 2)
    assert agg_loss(loss, mask, "seq-mean-token-sum-norm").item() == pytest.approx(7 / 6)
    d = Denominators.of(mask)
    assert (d.tokens, d.seqs, d.norm_len) == (3.0, 2.0, 3.0)
    assert Denominators.of(mask, norm_len=10).norm_len == 10.0


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("seed", range(4))
def test_matches_naive_loop(mode, seed):
    loss, mask = rand_batch(5, 7, seed)
    mask[seed % 5] = False                                     # at least one empty row
    assert agg_loss(loss, mask, mode).item() == pytest.approx(naive_agg(loss, mask, mode),
                                                              abs=1e-12)


@pytest.mark.parametrize("mode", MODES)
def test_zero_valid_tokens_gives_zero_and_a_graph(mode):
    loss = torch.full((2, 3), float("nan"), dtype=F64, requires_grad=True)
    out = agg_loss(loss, torch.zeros(2, 3, dtype=torch.bool), mode)
    assert out.item() == 0.0
    out.backward()                                             # a padding micro-batch can backprop
    assert torch.equal(loss.grad, torch.zeros(2, 3, dtype=F64))
    out = agg_loss(loss, torch.zeros(2, 3, dtype=torch.bool), mode,
                   denom=Denominators(tokens=5, seqs=2, norm_len=3))
    assert out.item() == 0.0


@pytest.mark.parametrize("mode", MODES)
def test_values_under_mask_do_not_matter_even_nan(mode):
    loss, mask = rand_batch(4, 6, seed=11)
    poisoned = torch.where(mask, loss, torch.tensor([float("nan"), float("inf")], dtype=F64)
                           .repeat(12).reshape(4, 6))
    x = poisoned.clone().requires_grad_(True)
    out = agg_loss(x, mask, mode)
    assert out.item() == pytest.approx(naive_agg(loss, mask, mode), abs=1e-12)
    out.backward()
    assert torch.isfinite(x.grad).all() and (x.grad[~mask] == 0).all()


def test_gradient_of_token_mean_is_mask_over_count():
    loss, mask = rand_batch(3, 4, seed=3)
    x = loss.clone().requires_grad_(True)
    agg_loss(x, mask, "token-mean").backward()
    torch.testing.assert_close(x.grad, mask.to(F64) / mask.sum(), rtol=0, atol=1e-15)


@given(b=st.integers(1, 9), r=st.integers(1, 6), seed=st.integers(0, 2**16),
       cuts=st.lists(st.integers(0, 9), max_size=4), p_valid=st.sampled_from([0.0, 0.3, 0.9]),
       norm_len=st.sampled_from([None, 11.0]))
def test_split_property(b, r, seed, cuts, p_valid, norm_len):
    """Sum over a random row split of the parts' contributions == the whole batch's value."""
    loss, mask = rand_batch(b, r, seed, p_valid)
    g = torch.Generator().manual_seed(seed + 1)
    perm = torch.randperm(b, generator=g)                      # parts need not be contiguous
    bounds = sorted({0, b, *[c for c in cuts if c <= b]})
    parts = [perm[lo:hi] for lo, hi in zip(bounds, bounds[1:])]
    whole = Denominators.of(mask, norm_len=norm_len)
    for mode in MODES:
        expected = naive_agg(loss, mask, mode, norm_len)
        assert agg_loss(loss, mask, mode, denom=whole).item() == pytest.approx(expected, abs=1e-12)
        total = sum(agg_loss(loss[idx], mask[idx], mode, denom=whole).item() for idx in parts)
        assert total == pytest.approx(expected, abs=1e-12), mode
    # Per-part denominators add up to the whole batch's.
    per_part = [Denominators.of(mask[idx], norm_len=norm_len) for idx in parts]
    assert functools.reduce(operator.add, per_part) == whole


def test_norm_len_is_a_constant_not_the_part_width():
    loss, mask = rand_batch(4, 8, seed=5, p_valid=1.0)
    whole = Denominators.of(mask)                              # L = 8
    narrow = agg_loss(loss[:2, :5], mask[:2, :5], "seq-mean-token-sum-norm", denom=whole)
    expected = float(loss[:2, :5].sum()) / (4 * 8)
    assert narrow.item() == pytest.approx(expected, abs=1e-12)


def test_inconsistent_zero_denominator_raises():
    loss, mask = rand_batch(2, 3, seed=0, p_valid=1.0)
    with pytest.raises(InputError, match="denom"):
        agg_loss(loss, mask, "token-mean", denom=Denominators(0, 0, 3))
    with pytest.raises(InputError, match="mask"):
        agg_loss(loss, mask[:, :2], "token-mean")
    with pytest.raises(InputError, match="norm_len"):
        Denominators(1, 1, 3) + Denominators(1, 1, 4)


def test_masked_reductions():
    x = torch.tensor([[1.0, float("nan"), -3.0], [float("inf"), 5.0, 2.0]], dtype=F64)
    m = torch.tensor([[True, False, True], [False, True, False]])
    assert masked_sum(x, m).item() == 3.0
    assert masked_mean(x, m).item() == 1.0
    assert masked_max(x, m).item() == 5.0
    assert masked_min(x, m).item() == -3.0
    none = torch.zeros_like(m)
    assert masked_mean(x, none).item() == 0.0 and masked_sum(x, none).item() == 0.0
    assert masked_max(x, none).item() == 0.0
    assert math.isnan(masked_min(x, none, empty=float("nan")).item())
    assert masked_mean(x, m.to(torch.float32)).item() == 1.0   # 0/1 float masks work too


def test_every_masked_function_rejects_a_mask_that_is_not_0_1():
    """One converter (agg.bool_mask) for every algo function: a float mask of 0/1 is accepted
    and equals the bool mask; 0.5 (a weight passed where a mask belongs) is an InputError."""
    from rlaudit.algo.policy_loss import compute_policy_loss
    from rlaudit.algo.value_loss import value_loss
    x = torch.tensor([[0.3, -1.2, 2.0], [0.7, 0.1, -0.4]], dtype=torch.float64)
    good = torch.tensor([[1.0, 0.0, 1.0], [1.0, 1.0, 0.0]], dtype=torch.float64)
    calls = {
        "agg_loss": lambda m: agg_loss(x, m, "token-mean"),
        "masked_mean": lambda m: masked_mean(x, m),
        "masked_max": lambda m: masked_max(x, m),
        "Denominators.of": lambda m: torch.tensor(Denominators.of(m).tokens),
        "policy_loss": lambda m: compute_policy_loss(
            "vanilla", old_log_prob=x * 0.9, log_prob=x, advantages=x + 1, mask=m,
            clip_ratio_low=0.2, clip_ratio_high=0.2, clip_ratio_c=3.0).loss_mat,
        "value_loss": lambda m: value_loss(x, x * 0.5, x + 1, m, cliprange_value=0.2)[0],
    }
    for name, call in calls.items():
        assert torch.equal(call(good), call(good.bool())), name
        bad = good.clone()
        bad[0, 0] = 0.5
        with pytest.raises(InputError, match="only 0 and 1"):
            call(bad)
