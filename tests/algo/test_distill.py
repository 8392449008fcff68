"""Distillation losses: hand numbers, naive loops, and nested (jagged) == padded for values and
gradients (verl PR #5997), including length-0 and length-1 rows."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

from rlaudit.algo.distill import (DISTILL_LOSSES, compute_distill_loss, forward_kl_topk,
                                  gather_topk, k3)
from rlaudit.errors import InputError, UnknownNameError

F64 = torch.float64
LN2 = math.log(2)


def nested(values, lengths):
    """Jagged nested tensor over ``values`` [N, ...] (a view: gradients reach ``values``)."""
    offs = torch.tensor([0] + lengths).cumsum(0)
    return torch.nested.nested_tensor_from_jagged(values, offs)


def padded(values, lengths, width, fill=float("nan")):
    """[B, width, ...] built row by row with ``fill`` in the padding (NaN: must never leak)."""
    rows, start = [], 0
    for n in lengths:
        row = values[start:start + n]
        pad = [0, 0] * (values.dim() - 1) + [0, width - n]
        rows.append(F.pad(row, pad, value=fill))
        start += n
    mask = torch.arange(width).unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)
    return torch.stack(rows), mask


def test_registry():
    assert DISTILL_LOSSES.names() == ["forward_kl_topk", "k3"]
    with pytest.raises(UnknownNameError, match="actor.distill.loss_type"):
        compute_distill_loss("reverse_kl", torch.zeros(1, 1), torch.zeros(1, 1))


def test_forward_kl_topk_hand_worked():
    s = torch.tensor([[[math.log(0.25), math.log(0.5)]]], dtype=F64, requires_grad=True)
    t = torch.tensor([[[math.log(0.5), math.log(0.25)]]], dtype=F64)
    loss = forward_kl_topk(s, t)
    # 0.5 (ln .5 - ln .25) + 0.25 (ln .25 - ln .5) = 0.25 ln 2; d/ds = -p_T
    assert loss.item() == pytest.approx(0.25 * LN2, abs=1e-15)
    loss.sum().backward()
    assert s.grad.tolist() == [[[-0.5, -0.25]]]


def test_forward_kl_topk_zero_teacher_prob_contributes_nothing():
    s = torch.tensor([[[math.log(0.5), float("-inf")]]], dtype=F64, requires_grad=True)
    t = torch.tensor([[[math.log(0.5), float("-inf")]]], dtype=F64)
    loss = forward_kl_topk(s, t)
    assert loss.item() == 0.0
    loss.sum().backward()
    assert torch.isfinite(s.grad).all()


def test_k3_hand_worked():
    s = torch.tensor([[math.log(0.5)]], dtype=F64, requires_grad=True)
    t = torch.tensor([[math.log(0.25)]], dtype=F64)
    loss = k3(s, t)
    # t - s = -ln 2: exp(-ln 2) + ln 2 - 1; d/ds = 1 - exp(t - s) = 0.5
    assert loss.item() == pytest.approx(LN2 - 0.5, abs=1e-15)
    loss.sum().backward()
    assert s.grad.item() == pytest.approx(0.5, abs=1e-15)


def test_k3_uses_the_kl_estimator_clamp():
    # t - s = 3: exp(3) - 4 = 16.09 is capped at 10 by kl.py's k3 (verl's bound), gradient 0 there
    s = torch.tensor([[-3.0, -1.0]], dtype=F64, requires_grad=True)
    loss = k3(s, torch.tensor([[0.0, 0.0]], dtype=F64))
    assert loss[0, 0].item() == 10.0
    assert loss[0, 1].item() == pytest.approx(math.exp(1) - 2, abs=1e-15)
    loss.sum().backward()
    assert s.grad[0].tolist() == pytest.approx([0.0, 1 - math.exp(1)], abs=1e-15)


@st.composite
def ragged(draw):
    lengths = draw(st.lists(st.integers(0, 4), min_size=1, max_size=5))
    if draw(st.booleans()):
        lengths[0] = 1                                   # always cover a length-1 row sometimes
    k = draw(st.integers(1, 4))
    seed = draw(st.integers(0, 2**16))
    return lengths, k, seed


def _naive_fkl(s, t):
    return sum(math.exp(tk) * (tk - sk) for sk, tk in zip(s, t))


@given(case=ragged())
def test_forward_kl_topk_nested_equals_padded_and_naive(case):
    lengths, k, seed = case
    g = torch.Generator().manual_seed(seed)
    n = sum(lengths)
    s_vals = torch.randn(n, k, generator=g, dtype=F64).log_softmax(-1).requires_grad_()
    t_vals = torch.randn(n, k, generator=g, dtype=F64).log_softmax(-1)
    width = max(lengths) + 1
    s_pad, mask = padded(s_vals, lengths, width)
    t_pad, _ = padded(t_vals, lengths, width)

    loss_p = forward_kl_topk(s_pad, t_pad, mask)
    (grad_p,) = torch.autograd.grad((loss_p * 1.5).sum(), s_vals)
    loss_n = forward_kl_topk(nested(s_vals, lengths), nested(t_vals, lengths))
    assert loss_n.is_nested
    assert loss_n.offsets().tolist() == [0] + torch.tensor(lengths).cumsum(0).tolist()
    (grad_n,) = torch.autograd.grad((loss_n.values() * 1.5).sum(), s_vals)

    assert torch.equal(loss_p[mask], loss_n.values())
    assert not loss_p[~mask].any() and not torch.isnan(grad_p).any()
    assert torch.equal(grad_p, grad_n)
    for i, row in enumerate(loss_n.values().detach().tolist()):
        assert row == pytest.approx(_naive_fkl(s_vals[i].tolist(), t_vals[i].tolist()), abs=1e-12)
    assert torch.allclose(grad_n, -1.5 * t_vals.exp(), atol=1e-15, rtol=0)


@given(case=ragged())
def test_k3_nested_equals_padded_and_naive(case):
    lengths, _, seed = case
    g = torch.Generator().manual_seed(seed)
    n = sum(lengths)
    # |t - s| <= 1.5 keeps k3 below kl.py's value clamp (10), tested separately below
    s_vals = (-1.5 * torch.rand(n, generator=g, dtype=F64)).requires_grad_()
    t_vals = -1.5 * torch.rand(n, generator=g, dtype=F64)
    width = max(lengths) + 2
    s_pad, mask = padded(s_vals, lengths, width)
    t_pad, _ = padded(t_vals, lengths, width)

    loss_p = compute_distill_loss("k3", s_pad, t_pad, mask.float())
    (grad_p,) = torch.autograd.grad(loss_p.sum(), s_vals)
    loss_n = compute_distill_loss("k3", nested(s_vals, lengths), nested(t_vals, lengths))
    (grad_n,) = torch.autograd.grad(loss_n.values().sum(), s_vals)

    assert torch.equal(loss_p[mask], loss_n.values()) and torch.equal(grad_p, grad_n)
    assert not loss_p[~mask].any()
    for i in range(n):
        d = t_vals[i].item() - s_vals[i].item()
        assert loss_n.values()[i].item() == pytest.approx(math.exp(d) - d - 1, abs=1e-12)
        assert grad_n[i].item() == pytest.approx(1 - math.exp(d), abs=1e-12)


def test_all_rows_empty_nested():
    s = nested(torch.zeros(0, 3, dtype=F64, requires_grad=True), [0, 0])
    out = forward_kl_topk(s, nested(torch.zeros(0, 3, dtype=F64), [0, 0]))
    assert out.is_nested and out.values().shape == (0,)


@given(case=ragged())
def test_gather_topk_nested_equals_padded(case):
    lengths, k, seed = case
    g = torch.Generator().manual_seed(seed)
    n, vocab = sum(lengths), 6
    lp = torch.randn(n, vocab, generator=g, dtype=F64).log_softmax(-1).requires_grad_()
    ids = torch.randint(0, vocab, (n, k), generator=g)
    width = max(lengths)
    lp_pad, mask = padded(lp, lengths, width, fill=0.0)
    ids_pad, _ = padded(ids, lengths, width, fill=0)
    out_p = gather_topk(lp_pad, ids_pad)
    out_n = gather_topk(nested(lp, lengths), nested(ids, lengths))
    for i in range(n):
        for j in range(k):
            assert out_n.values()[i, j].item() == lp[i, ids[i, j]].item()
    assert torch.equal(out_p[mask], out_n.values())
    (gp,) = torch.autograd.grad(out_p[mask].sum(), lp)
    (gn,) = torch.autograd.grad(out_n.values().sum(), lp)
    assert torch.equal(gp, gn)


def test_bad_inputs():
    s = torch.zeros(2, 3, 4, dtype=F64)
    with pytest.raises(InputError, match="teacher_topk_log_probs.*\\(2, 3, 4\\)"):
        forward_kl_topk(s, torch.zeros(2, 3, 5, dtype=F64))
    with pytest.raises(InputError, match="student_topk_log_probs.*\\[B, R, K\\]"):
        forward_kl_topk(s[..., 0], s[..., 0])
    with pytest.raises(InputError, match="mask"):
        forward_kl_topk(s, s, torch.ones(2, 4, dtype=torch.bool))
    ns = nested(torch.zeros(3, 4, dtype=F64), [1, 2])
    with pytest.raises(InputError, match="both be nested or both padded"):
        forward_kl_topk(ns, s)
    with pytest.raises(InputError, match="row lengths"):
        forward_kl_topk(ns, nested(torch.zeros(3, 4, dtype=F64), [2, 1]))
    with pytest.raises(InputError, match="mask=None"):
        forward_kl_topk(ns, ns, torch.ones(2, 2, dtype=torch.bool))
    with pytest.raises(InputError, match="teacher_log_probs"):
        k3(torch.zeros(2, 3, dtype=F64), torch.zeros(2, 3, dtype=torch.long))
    with pytest.raises(InputError, match="topk_ids.*\\[0, V=4\\)"):
        gather_topk(s, torch.full((2, 3, 1), 4))
