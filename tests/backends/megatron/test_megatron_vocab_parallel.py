"""vocab_parallel log-probs/entropy on one process (tp_group=None): math, gradients, hygiene.

The multi-rank version (TP=2, values and gradients against full-vocab references, a rank holding
only padding columns) runs in test_megatron_parity.py.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from rlaudit.algo.logprob import log_probs_at, logprobs_from_logits
from rlaudit.backends.megatron.vocab_parallel import (vocab_parallel_log_probs_at,
                                                      vocab_parallel_logprobs_entropy)
from rlaudit.errors import InputError


def naive(logits: list[list[float]], labels: list[int], temperature: float):
    """Per-row log-prob and entropy with Python floats (the definition, nothing shared)."""
    logps, ents = [], []
    for row, label in zip(logits, labels):
        z = [x / temperature for x in row]
        log_z = math.log(sum(math.exp(x) for x in z))
        logp = [x - log_z for x in z]
        logps.append(logp[label])
        ents.append(-sum(math.exp(lp) * lp for lp in logp))
    return logps, ents


def test_matches_a_python_loop():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 7, generator=g, dtype=torch.float64) * 3
    labels = torch.tensor([0, 6, 3, 3, 1])
    logp, ent = vocab_parallel_logprobs_entropy(logits, labels, temperature=0.7, calc_entropy=True)
    ref_lp, ref_ent = naive(logits.tolist(), labels.tolist(), 0.7)
    assert torch.allclose(logp, torch.tensor(ref_lp, dtype=torch.float64), atol=1e-12, rtol=0)
    assert torch.allclose(ent, torch.tensor(ref_ent, dtype=torch.float64), atol=1e-12, rtol=0)
    lp_only, none = vocab_parallel_logprobs_entropy(logits, labels, temperature=0.7)
    assert none is None and torch.equal(lp_only, logp)  # the entropy terms never enter logp


def test_hand_worked_uniform_logits():
    logits = torch.zeros(2, 4, dtype=torch.float64)  # p = 1/4 everywhere
    logp, ent = vocab_parallel_logprobs_entropy(logits, torch.tensor([1, 3]), calc_entropy=True)
    assert torch.allclose(logp, torch.full((2,), -math.log(4.0), dtype=torch.float64))
    assert torch.allclose(ent, torch.full((2,), math.log(4.0), dtype=torch.float64))


@given(rows=st.integers(1, 6), vocab=st.integers(1, 9), pad=st.integers(0, 3),
       temperature=st.floats(0.25, 3.0), scale=st.floats(0.1, 20.0), seed=st.integers(0, 2**16))
def test_matches_rlaudit_logprob_on_the_real_columns(rows, vocab, pad, temperature, scale, seed):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, 2, vocab + pad, generator=g, dtype=torch.float64) * scale
    labels = torch.randint(0, vocab, (rows, 2), generator=g)
    ids = torch.randint(0, vocab, (rows, 2, 3), generator=g)
    logp, ent = vocab_parallel_logprobs_entropy(logits, labels, temperature=temperature,
                                                calc_entropy=True, vocab_size=vocab)
    ref_lp, ref_ent = logprobs_from_logits(logits[..., :vocab], labels, temperature=temperature,
                                           calc_entropy=True)
    assert torch.allclose(logp, ref_lp, atol=1e-10, rtol=1e-10)
    assert torch.allclose(ent, ref_ent, atol=1e-10, rtol=1e-10)
    at = vocab_parallel_log_probs_at(logits, ids, temperature=temperature, vocab_size=vocab)
    assert torch.allclose(at, log_probs_at(logits[..., :vocab], ids, temperature=temperature),
                          atol=1e-10, rtol=1e-10)


def test_gradients_pass_gradcheck_and_padding_columns_get_none():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 4, 6, generator=g, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 5, (3, 4), generator=g)
    ids = torch.randint(0, 5, (3, 4, 2), generator=g)

    def both(t):
        return vocab_parallel_logprobs_entropy(t, labels, temperature=0.9, calc_entropy=True,
                                               vocab_size=5)

    assert torch.autograd.gradcheck(both, (x,))
    assert torch.autograd.gradcheck(
        lambda t: vocab_parallel_logprobs_entropy(t, labels, vocab_size=5)[0], (x,))
    assert torch.autograd.gradcheck(
        lambda t: vocab_parallel_log_probs_at(t, ids, temperature=1.3, vocab_size=5), (x,))
    logp, ent = both(x)
    (logp.sum() + ent.sum()).backward()
    assert torch.equal(x.grad[..., 5], torch.zeros(3, 4, dtype=torch.float64))


def test_gradient_equals_autograd_through_log_softmax():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(4, 8, generator=g, dtype=torch.float64, requires_grad=True)
    y = x.detach().clone().requires_grad_(True)
    labels = torch.randint(0, 8, (4,), generator=g)
    w = torch.randn(4, generator=g, dtype=torch.float64)
    logp, ent = vocab_parallel_logprobs_entropy(x, labels, temperature=0.5, calc_entropy=True)
    (w * logp - 0.3 * ent).sum().backward()
    ls = torch.log_softmax(y / 0.5, -1)
    (w * ls.gather(-1, labels[:, None])[:, 0] + 0.3 * (ls.exp() * ls).sum(-1)).sum().backward()
    assert torch.allclose(x.grad, y.grad, atol=1e-13, rtol=0)


def test_input_untouched_outputs_new_and_entropy_optional():
    x = torch.randn(2, 3, 5)
    before, version = x.clone(), x._version
    logp, ent = vocab_parallel_logprobs_entropy(x, torch.zeros(2, 3, dtype=torch.long))
    assert ent is None
    assert torch.equal(x, before) and x._version == version
    assert logp.untyped_storage().data_ptr() != x.untyped_storage().data_ptr()


def test_bf16_logits_are_reduced_in_float32_and_returned_in_bf16():
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(4, 50, generator=g) * 4).bfloat16()
    labels = torch.randint(0, 50, (4,), generator=g)
    logp, ent = vocab_parallel_logprobs_entropy(x, labels, calc_entropy=True)
    ls = torch.log_softmax(x.double(), -1)  # the bf16 values, reduced in float64
    assert logp.dtype == ent.dtype == torch.bfloat16
    # within bf16 rounding of the result (8 bits of mantissa), i.e. reduced in >= float32
    assert torch.allclose(logp.double(), ls.gather(-1, labels[:, None])[:, 0], rtol=8e-3, atol=1e-3)
    assert torch.allclose(ent.double(), -(ls.exp() * ls).sum(-1), rtol=8e-3, atol=1e-3)


@pytest.mark.parametrize("kwargs,labels,match", [
    ({"temperature": 0.0}, [1, 2], "temperature"),
    ({"vocab_size": 5}, [1, 5], "labels"),          # id 5 is a padding column
    ({"vocab_size": 7}, [1, 2], "vocab_size"),      # more than the 6 columns
    ({}, [[1, 2]], "labels"),                        # wrong shape
    ({}, [1.0, 2.0], "labels"),                      # not integer ids
])
def test_bad_arguments_raise_input_error(kwargs, labels, match):
    with pytest.raises(InputError, match=match):
        vocab_parallel_logprobs_entropy(torch.zeros(2, 6), torch.tensor(labels), **kwargs)


def test_log_probs_at_rejects_bad_ids():
    with pytest.raises(InputError, match="ids"):
        vocab_parallel_log_probs_at(torch.zeros(2, 6), torch.zeros(2, dtype=torch.long))
    with pytest.raises(InputError, match="ids"):
        vocab_parallel_log_probs_at(torch.zeros(2, 6), torch.full((2, 1), 6))


@pytest.mark.parametrize("cuts", [(7,), (3, 7), (0, 2, 2, 7), (1, 4, 6, 7)])
@pytest.mark.parametrize("gap", [0.0, 40.0, 800.0])
def test_shard_statistics_combine_to_the_whole_vocabulary(cuts, gap):
    """Each TP rank summarises its own columns relative to its own max and the ranks' summaries
    are combined (one all-gather): any split, including a rank with no column (all padding) and
    shards whose maxima differ by so much that exp(m_r - m) underflows to 0, gives the whole
    row's logsumexp, entropy and label logit (the Python loop above is the definition)."""
    from rlaudit.backends.megatron.vocab_parallel import _combine, _shard_stats

    g = torch.Generator().manual_seed(len(cuts))
    logits = torch.randn(4, 7, generator=g, dtype=torch.float64) * 3
    logits[:, 5:] += gap                                   # the last columns dominate
    labels = torch.tensor([0, 6, 3, 5])
    parts, start = [], 0
    for end in cuts:
        local = labels - start
        owned = (local >= 0) & (local < end - start)
        parts.append(_shard_stats(logits[:, start:end], local, owned, calc_entropy=True))
        start = end
    m, sum_exp, sum_ezc, target = _combine(parts)
    # the definition on logits shifted by each row's max (softmax does not see a shift; Python's
    # exp(800) would overflow)
    shifted = logits - logits.amax(-1, keepdim=True)
    ref_lp, ref_ent = naive(shifted.tolist(), labels.tolist(), 1.0)
    logp = target - m - sum_exp.log()
    entropy = sum_exp.log() - sum_ezc / sum_exp
    assert torch.allclose(logp, torch.tensor(ref_lp, dtype=torch.float64), atol=1e-10, rtol=0)
    assert torch.allclose(entropy, torch.tensor(ref_ent, dtype=torch.float64), atol=1e-10, rtol=0)
    assert torch.isfinite(sum_exp).all() and torch.isfinite(sum_ezc).all()
