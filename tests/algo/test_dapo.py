"""DAPO overlong penalty and group filtering: the walkthrough's formulas, worked by hand."""

from __future__ import annotations

import statistics
from collections import defaultdict

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from rlaudit.algo.dapo import filter_groups, num_kept_groups, overlong_penalty
from rlaudit.errors import InputError


def test_overlong_penalty_hand_worked():
    # max 20, buffer 4 -> expected 16; factor 1: len 16 -> 0, 17 -> -0.25, 18 -> -0.5, 20 -> -1
    out = overlong_penalty(torch.tensor([0, 10, 16, 17, 18, 20]), max_response_length=20,
                           buffer_len=4, penalty_factor=1.0, dtype=torch.float64)
    assert torch.equal(out, torch.tensor([0, 0, 0, -0.25, -0.5, -1.0], dtype=torch.float64))
    # factor 2, buffer 8 of 16 -> expected 8: len 12 -> -(4/8)*2 = -1
    out = overlong_penalty(torch.tensor([12, 8, 3]), max_response_length=16, buffer_len=8,
                           penalty_factor=2.0)
    assert out.dtype == torch.float32
    assert out.tolist() == [-1.0, 0.0, 0.0]


@given(lens=st.lists(st.integers(0, 32), min_size=1, max_size=8), buf=st.integers(1, 16),
       factor=st.sampled_from([0.0, 0.5, 1.0, 3.0]))
def test_overlong_penalty_formula(lens, buf, factor):
    out = overlong_penalty(torch.tensor(lens), max_response_length=32, buffer_len=buf,
                           penalty_factor=factor, dtype=torch.float64)
    for n, got in zip(lens, out.tolist()):
        exceed = n - (32 - buf)
        assert got == pytest.approx(min(-exceed / buf * factor, 0), abs=1e-12)


def test_overlong_penalty_bad_config():
    lens = torch.tensor([1])
    with pytest.raises(InputError, match="overlong_buffer.len"):
        overlong_penalty(lens, max_response_length=8, buffer_len=0, penalty_factor=1.0)
    with pytest.raises(InputError, match="overlong_buffer.len"):
        overlong_penalty(lens, max_response_length=4, buffer_len=8, penalty_factor=1.0)
    with pytest.raises(InputError, match="penalty_factor"):
        overlong_penalty(lens, max_response_length=8, buffer_len=2, penalty_factor=-1.0)
    with pytest.raises(InputError, match="response_lengths"):
        overlong_penalty(torch.tensor([1.0]), max_response_length=8, buffer_len=2,
                         penalty_factor=1.0)


def test_filter_groups_hand_worked():
    # uid 5: [1, 0, 1] varies -> keep; uid 9: [1, 1] constant -> drop; uid -2: singleton -> keep;
    # uid 4: [0, 0] -> drop. Rows interleaved on purpose.
    uid = torch.tensor([5, 9, 5, -2, 9, 4, 5, 4])
    metric = torch.tensor([1.0, 1.0, 0.0, 0.0, 1.0, 0.0, 1.0, 0.0])
    keep = filter_groups(uid, metric)
    assert keep.tolist() == [True, False, True, True, False, False, True, False]
    assert num_kept_groups(uid, keep) == 2


def test_filter_groups_equal_floats_are_dropped():
    # np.std of three equal 0.1s is a tiny positive number in float64; "std > 0" must still be false
    uid = torch.tensor([1, 1, 1])
    metric = torch.tensor([0.1, 0.1, 0.1], dtype=torch.float64)
    assert not filter_groups(uid, metric).any()


@given(rows=st.lists(st.tuples(st.integers(-3, 3), st.integers(0, 2)), min_size=0, max_size=12))
def test_filter_groups_naive(rows):
    uid = torch.tensor([u for u, _ in rows], dtype=torch.long)
    metric = torch.tensor([float(v) for _, v in rows], dtype=torch.float64)
    vals = defaultdict(list)
    for u, v in rows:
        vals[u].append(float(v))
    want = [statistics.pstdev(vals[u]) > 0 or len(vals[u]) == 1 for u, _ in rows]
    assert filter_groups(uid, metric).tolist() == want


def test_filter_groups_bad_inputs():
    with pytest.raises(InputError, match="metric"):
        filter_groups(torch.tensor([1, 2]), torch.tensor([0.0]))
    with pytest.raises(InputError, match="metric.*finite"):
        filter_groups(torch.tensor([1, 1]), torch.tensor([0.0, float("nan")]))
    with pytest.raises(InputError, match="uid"):
        filter_groups(torch.tensor([1.0, 2.0]), torch.tensor([0.0, 1.0]))
