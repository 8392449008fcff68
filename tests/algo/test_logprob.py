"""Chunked log-probs/entropy against the naive full-softmax computation, values and gradients."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from rlaudit.algo.logprob import entropy_from_logits, log_probs_at, logprobs_from_logits
from rlaudit.errors import InputError

F64 = torch.float64


def naive(logits, labels, temperature=1.0):
    """Full log_softmax / softmax over V: the textbook formulas, no chunking."""
    logp_all = torch.log_softmax(logits / temperature, dim=-1)
    logp = logp_all.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy


def rand_case(shape, v, seed, dtype=F64, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(*shape, v, generator=g, dtype=F64) * scale).to(dtype)
    labels = torch.randint(0, v, shape, generator=g)
    return logits, labels


@pytest.mark.parametrize("temperature", [1.0, 0.6, 1.7])
@pytest.mark.parametrize("chunk_size", [1, 3, 7, 1024])
def test_values_match_naive(temperature, chunk_size):
    logits, labels = rand_case((5, 7), 13, seed=1)      # 35 rows: chunk 3 leaves a remainder
    logp, ent = logprobs_from_logits(logits, labels, temperature=temperature,
                                     calc_entropy=True, chunk_size=chunk_size)
    ref_logp, ref_ent = naive(logits, labels, temperature)
    assert logp.shape == labels.shape and ent.shape == labels.shape
    torch.testing.assert_close(logp, ref_logp, rtol=0, atol=1e-12)
    torch.testing.assert_close(ent, ref_ent, rtol=0, atol=1e-12)


def test_hand_worked_uniform_and_two_point():
    # Uniform over 4 tokens: log p = -log 4, entropy = log 4.
    logits = torch.zeros(1, 4, dtype=F64)
    logp, ent = logprobs_from_logits(logits, torch.tensor([2]), calc_entropy=True)
    assert logp.item() == pytest.approx(-math.log(4), abs=1e-15)
    assert ent.item() == pytest.approx(math.log(4), abs=1e-15)
    # logits (log 3, 0) at T=1: p = (3/4, 1/4).
    logits = torch.tensor([[math.log(3), 0.0]], dtype=F64)
    logp, ent = logprobs_from_logits(logits, torch.tensor([0]), calc_entropy=True)
    assert logp.item() == pytest.approx(math.log(0.75), abs=1e-15)
    assert ent.item() == pytest.approx(-(0.75 * math.log(0.75) + 0.25 * math.log(0.25)),
                                       abs=1e-15)
    # At T=2, logits/T = (log 3 / 2, 0) = (log sqrt 3, 0): p = (sqrt 3, 1) / (sqrt 3 + 1).
    s = math.sqrt(3)
    logp, _ = logprobs_from_logits(logits, torch.tensor([1]), temperature=2.0)
    assert logp.item() == pytest.approx(math.log(1 / (s + 1)), abs=1e-15)


@pytest.mark.parametrize("which", ["both", "logp", "entropy"])
@pytest.mark.parametrize("temperature", [1.0, 0.8])
def test_gradients_match_naive_autograd(which, temperature):
    logits, labels = rand_case((3, 5), 17, seed=2)
    g = torch.Generator().manual_seed(3)
    w_lp, w_h = torch.randn(3, 5, generator=g, dtype=F64), torch.randn(3, 5, generator=g, dtype=F64)

    def objective(lp, h):
        return {"both": (lp * w_lp).sum() + (h * w_h).sum(), "logp": (lp * w_lp).sum(),
                "entropy": (h * w_h).sum()}[which]

    x = logits.clone().requires_grad_(True)
    lp, h = logprobs_from_logits(x, labels, temperature=temperature, calc_entropy=True,
                                 chunk_size=4)
    (grad,) = torch.autograd.grad(objective(lp, h), x)
    y = logits.clone().requires_grad_(True)
    (ref,) = torch.autograd.grad(objective(*naive(y, labels, temperature)), y)
    torch.testing.assert_close(grad, ref, rtol=0, atol=1e-12)


def test_gradcheck_float64():
    logits, labels = rand_case((5,), 6, seed=4)
    x = logits.requires_grad_(True)
    assert torch.autograd.gradcheck(
        lambda t: logprobs_from_logits(t, labels, temperature=0.7, calc_entropy=True,
                                       chunk_size=2), (x,))
    ids = torch.tensor([[0, 5, 5], [1, 2, 3], [4, 4, 0], [2, 1, 0], [3, 3, 3]])
    assert torch.autograd.gradcheck(lambda t: log_probs_at(t, ids, temperature=1.3, chunk_size=3),
                                    (x,))
    assert torch.autograd.gradcheck(lambda t: entropy_from_logits(t, chunk_size=2), (x,))


def test_masked_vocab_entries_give_finite_values_and_grads():
    logits, labels = rand_case((6,), 9, seed=5)
    masked = torch.zeros(6, 9, dtype=torch.bool)
    masked[:, 5:] = True                                 # a vocabulary of 5 valid ids
    masked[0, :4] = True                                 # row 0: only id 4 is valid
    labels = torch.tensor([4, 0, 1, 2, 3, 4])            # always a valid id
    x = logits.masked_fill(masked, float("-inf")).requires_grad_(True)
    lp, h = logprobs_from_logits(x, labels, temperature=0.9, calc_entropy=True, chunk_size=4)
    assert torch.isfinite(lp).all() and torch.isfinite(h).all()
    assert lp[0].item() == 0.0 and h[0].item() == 0.0    # a one-point distribution
    (grad,) = torch.autograd.grad(lp.sum() + 2 * h.sum(), x)
    assert not torch.isnan(grad).any()
    assert (grad[masked] == 0).all()
    # Independent reference: the same rows with the vocabulary restricted by a finite -1e30,
    # where exp() underflows to exactly 0 as well.
    y = logits.masked_fill(masked, -1e30).requires_grad_(True)
    rlp, rh = naive(y, labels, 0.9)
    (rgrad,) = torch.autograd.grad(rlp.sum() + 2 * rh.sum(), y)
    torch.testing.assert_close(lp, rlp, rtol=0, atol=1e-12)
    torch.testing.assert_close(h, rh, rtol=0, atol=1e-12)
    torch.testing.assert_close(grad, rgrad, rtol=0, atol=1e-12)


def test_label_on_masked_entry_is_minus_inf():
    logits = torch.tensor([[0.0, float("-inf"), 1.0]], dtype=F64)
    lp, h = logprobs_from_logits(logits, torch.tensor([1]), calc_entropy=True)
    assert lp.item() == float("-inf") and torch.isfinite(h).all()


@pytest.mark.parametrize("shape", [(0,), (2, 0), (0, 3)])
def test_empty_input(shape):
    x = torch.randn(*shape, 11, dtype=F64, requires_grad=True)
    labels = torch.zeros(shape, dtype=torch.int64)
    lp, h = logprobs_from_logits(x, labels, calc_entropy=True, chunk_size=4)
    assert lp.shape == shape and h.shape == shape
    (grad,) = torch.autograd.grad(lp.sum() + h.sum(), x)
    assert grad.shape == x.shape
    assert entropy_from_logits(x).shape == shape
    assert log_probs_at(x, torch.zeros(*shape, 2, dtype=torch.int64)).shape == (*shape, 2)


def test_no_entropy_returns_none_and_same_logp():
    logits, labels = rand_case((4, 3), 10, seed=6)
    lp, h = logprobs_from_logits(logits, labels)
    assert h is None
    torch.testing.assert_close(lp, naive(logits, labels)[0], rtol=0, atol=1e-12)


def test_inputs_not_modified_and_outputs_not_aliased():
    logits, labels = rand_case((4, 3), 10, seed=7)
    x = logits.clone().requires_grad_(True)
    before_l, before_lab = x.detach().clone(), labels.clone()
    v_x, v_l = x._version, labels._version
    lp, h = logprobs_from_logits(x, labels, temperature=0.5, calc_entropy=True, chunk_size=5)
    (lp.sum() + h.sum()).backward()
    assert x._version == v_x and labels._version == v_l
    assert torch.equal(x.detach(), before_l) and torch.equal(labels, before_lab)
    for out in (lp, h, x.grad):
        assert out.untyped_storage().data_ptr() != x.untyped_storage().data_ptr()


def test_log_probs_at_matches_naive_with_repeated_ids():
    logits, _ = rand_case((3, 4), 12, seed=8)
    g = torch.Generator().manual_seed(9)
    ids = torch.randint(0, 12, (3, 4, 5), generator=g)
    ids[0, 0] = torch.tensor([7, 7, 7, 1, 7])
    w = torch.randn(3, 4, 5, generator=g, dtype=F64)
    x = logits.clone().requires_grad_(True)
    out = log_probs_at(x, ids, temperature=1.4, chunk_size=5)
    (grad,) = torch.autograd.grad((out * w).sum(), x)
    y = logits.clone().requires_grad_(True)
    ref = torch.log_softmax(y / 1.4, dim=-1).gather(-1, ids)
    (rgrad,) = torch.autograd.grad((ref * w).sum(), y)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
    torch.testing.assert_close(grad, rgrad, rtol=0, atol=1e-12)


def test_entropy_from_logits_matches_loop():
    logits, _ = rand_case((2, 3), 6, seed=10)
    ent = entropy_from_logits(logits, temperature=0.5, chunk_size=4)
    for i in range(2):
        for j in range(3):
            z = [float(v) / 0.5 for v in logits[i, j]]
            mx = max(z)
            e = [math.exp(v - mx) for v in z]
            s = sum(e)
            expected = -sum((ei / s) * ((v - mx) - math.log(s)) for ei, v in zip(e, z))
            assert ent[i, j].item() == pytest.approx(expected, abs=1e-12)


def test_non_contiguous_logits():
    logits, labels = rand_case((4, 6), 9, seed=11)
    strided = logits.transpose(0, 1)                     # [6, 4, 9], not viewable as rows
    lab = labels.transpose(0, 1)
    lp, h = logprobs_from_logits(strided, lab, calc_entropy=True, chunk_size=5)
    rlp, rh = naive(strided, lab)
    torch.testing.assert_close(lp, rlp, rtol=0, atol=1e-12)
    torch.testing.assert_close(h, rh, rtol=0, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_low_precision_dtypes(dtype):
    logits, labels = rand_case((8,), 50, seed=12, dtype=dtype)
    x = logits.clone().requires_grad_(True)
    lp, h = logprobs_from_logits(x, labels, temperature=0.7, calc_entropy=True, chunk_size=3)
    assert lp.dtype == dtype and h.dtype == dtype
    (grad,) = torch.autograd.grad(lp.sum() + h.sum(), x)
    assert grad.dtype == dtype
    y = logits.to(F64).requires_grad_(True)
    rlp, rh = naive(y, labels, 0.7)
    (rgrad,) = torch.autograd.grad(rlp.sum() + rh.sum(), y)
    tol = {torch.float32: 1e-5, torch.bfloat16: 5e-2, torch.float16: 1e-2}[dtype]
    torch.testing.assert_close(lp.to(F64), rlp, rtol=tol, atol=tol)
    torch.testing.assert_close(h.to(F64), rh, rtol=tol, atol=tol)
    torch.testing.assert_close(grad.to(F64), rgrad, rtol=tol, atol=tol)


@given(rows=st.integers(0, 12), vocab=st.integers(1, 9), chunk=st.integers(1, 13),
       seed=st.integers(0, 2**16))
def test_any_chunk_size_matches_naive(rows, vocab, chunk, seed):
    logits, labels = rand_case((rows,), vocab, seed=seed)
    lp, h = logprobs_from_logits(logits, labels, calc_entropy=True, chunk_size=chunk)
    rlp, rh = naive(logits, labels)
    torch.testing.assert_close(lp, rlp, rtol=0, atol=1e-12)
    torch.testing.assert_close(h, rh, rtol=0, atol=1e-12)


def test_bad_arguments_raise_input_error():
    logits = torch.randn(3, 5)
    with pytest.raises(InputError, match="labels"):
        logprobs_from_logits(logits, torch.zeros(4, dtype=torch.int64))
    with pytest.raises(InputError, match="labels"):
        logprobs_from_logits(logits, torch.tensor([0, 5, 1]))
    with pytest.raises(InputError, match="labels"):
        logprobs_from_logits(logits, torch.zeros(3))
    with pytest.raises(InputError, match="temperature"):
        logprobs_from_logits(logits, torch.zeros(3, dtype=torch.int64), temperature=0.0)
    with pytest.raises(InputError, match="chunk_size"):
        entropy_from_logits(logits, chunk_size=0)
    with pytest.raises(InputError, match="logits"):
        entropy_from_logits(torch.zeros(3, 5, dtype=torch.int64))
    with pytest.raises(InputError, match="ids"):
        log_probs_at(logits, torch.zeros(3, 2, 1, dtype=torch.int64))
