"""Padded <-> packed <-> nested conversions, checked against naive per-row loops."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from rlaudit.data.packing import (lengths_to_offsets, nested_to_packed, nested_to_padded,
                                  packed_to_padded, pad_to_packed, padded_to_nested)
from rlaudit.errors import InputError


def naive_pack(x, lengths):
    """Rows' valid items back to back, built item by item."""
    items = [x[i, t] for i in range(x.shape[0]) for t in range(int(lengths[i]))]
    values = torch.stack(items) if items else x.new_zeros((0, *x.shape[2:]))
    offsets = [0]
    for n in lengths.tolist():
        offsets.append(offsets[-1] + n)
    return values, torch.tensor(offsets, dtype=torch.int64)


def naive_pad(x, lengths, pad_value):
    out = x.clone()
    for i in range(x.shape[0]):
        for t in range(int(lengths[i]), x.shape[1]):
            out[i, t] = pad_value
    return out


def example(dtype=torch.float64, trailing=()):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 4, *trailing, generator=g, dtype=torch.float64).to(dtype)
    lengths = torch.tensor([3, 0, 1, 4, 2])  # includes a length-0 and a length-1 row
    return x, lengths


@pytest.mark.parametrize("trailing", [(), (3,), (2, 2)])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.int64,
                                   torch.bool])
def test_pad_to_packed_matches_loop_and_round_trips(dtype, trailing):
    x, lengths = example(trailing=trailing)
    x = (x > 0) if dtype == torch.bool else (x * 10).to(dtype)
    values, offsets = pad_to_packed(x, lengths)
    want_values, want_offsets = naive_pack(x, lengths)
    assert values.dtype == dtype and offsets.dtype == torch.int64
    assert torch.equal(values, want_values)
    assert offsets.tolist() == [0, 3, 3, 4, 8, 10]
    assert torch.equal(offsets, want_offsets)
    pad = False if dtype == torch.bool else 7
    back = packed_to_padded(values, offsets, x.shape[1], pad_value=pad)
    assert back.dtype == dtype
    assert torch.equal(back, naive_pad(x, lengths, pad))


def test_packed_to_padded_hand_worked():
    values = torch.tensor([1.0, 2.0, 3.0, 4.0])
    offsets = torch.tensor([0, 2, 2, 3, 4])
    got = packed_to_padded(values, offsets, 3, pad_value=-1)
    assert got.tolist() == [[1, 2, -1], [-1, -1, -1], [3, -1, -1], [4, -1, -1]]
    assert packed_to_padded(values, offsets).shape == (4, 2)  # width defaults to the longest row


def test_nested_round_trip_and_rows():
    x, lengths = example(trailing=(3,))
    nt = padded_to_nested(x, lengths)
    assert nt.is_nested and nt.layout == torch.jagged
    for i, row in enumerate(nt.unbind()):
        assert torch.equal(row, x[i, : int(lengths[i])])
    assert torch.equal(nested_to_padded(nt, 4, pad_value=0.5), naive_pad(x, lengths, 0.5))
    assert nested_to_padded(nt).shape == (5, 4, 3)
    values, offsets = nested_to_packed(nt)
    want_values, want_offsets = naive_pack(x, lengths)
    assert torch.equal(values, want_values) and torch.equal(offsets, want_offsets)


def test_empty_batch_and_all_empty_rows():
    x = torch.zeros(0, 3, 2)
    values, offsets = pad_to_packed(x, torch.zeros(0, dtype=torch.long))
    assert values.shape == (0, 2) and offsets.tolist() == [0]
    assert packed_to_padded(values, offsets, 3).shape == (0, 3, 2)
    x = torch.ones(2, 3)
    values, offsets = pad_to_packed(x, torch.tensor([0, 0]))
    assert values.shape == (0,) and offsets.tolist() == [0, 0, 0]
    assert torch.equal(packed_to_padded(values, offsets, 3), torch.zeros(2, 3))


def test_gradients_flow_through_packing():
    x, lengths = example(trailing=(2,))
    x = x.requires_grad_()
    values, offsets = pad_to_packed(x, lengths)
    w = torch.arange(values.numel(), dtype=torch.float64).reshape(values.shape) + 1
    (values * w).sum().backward()
    want = torch.zeros_like(x)
    k = 0
    for i in range(5):
        for t in range(int(lengths[i])):
            want[i, t] = w[k]
            k += 1
    assert torch.equal(x.grad, want)

    v = torch.randn(6, dtype=torch.float64, requires_grad=True)
    off = torch.tensor([0, 1, 1, 6])
    weight = torch.randn(3, 5, dtype=torch.float64)
    (packed_to_padded(v, off, 5, pad_value=3.0) * weight).sum().backward()
    assert torch.equal(v.grad, torch.stack([weight[0, 0], *weight[2, :5]]))


def test_gradients_flow_through_nested():
    x, lengths = example()
    x = x.requires_grad_()
    padded = nested_to_padded(padded_to_nested(x, lengths), 4)
    (padded ** 2).sum().backward()
    assert torch.allclose(x.grad, naive_pad(2 * x.detach(), lengths, 0.0), rtol=0, atol=0)
    x.grad = None
    values, _ = nested_to_packed(padded_to_nested(x, lengths))
    values.sum().backward()
    assert torch.equal(x.grad, naive_pad(torch.ones_like(x), lengths, 0.0))


def test_outputs_do_not_alias_inputs():
    x, lengths = example()
    x_before = x.clone()
    values, offsets = pad_to_packed(x, lengths)
    values.add_(1.0)
    padded = packed_to_padded(values, offsets, 4)
    padded.mul_(0)
    assert torch.equal(x, x_before) and not torch.equal(values, torch.zeros_like(values))
    nt = padded_to_nested(x, lengths)
    v, o = nested_to_packed(nt)
    v.zero_()
    o.zero_()
    assert nt.values().abs().sum() > 0 and int(nt.offsets()[-1]) == int(lengths.sum())


@given(st.lists(st.integers(0, 5), min_size=0, max_size=6), st.integers(0, 3),
       st.sampled_from([(), (2,), (1, 3)]), st.integers(0, 2**31 - 1))
def test_round_trip_property(lengths, extra, trailing, seed):
    lengths = torch.tensor(lengths, dtype=torch.int64)
    width = (int(lengths.max()) if len(lengths) else 0) + extra
    x = torch.randn(len(lengths), width, *trailing, dtype=torch.float64,
                    generator=torch.Generator().manual_seed(seed))
    values, offsets = pad_to_packed(x, lengths)
    assert torch.equal(offsets, lengths_to_offsets(lengths))
    assert values.shape[0] == int(lengths.sum())
    assert torch.equal(packed_to_padded(values, offsets, width), naive_pad(x, lengths, 0.0))
    assert torch.equal(nested_to_padded(padded_to_nested(x, lengths), width),
                       naive_pad(x, lengths, 0.0))


@pytest.mark.parametrize("call, key", [
    (lambda: pad_to_packed(torch.zeros(3), torch.tensor([1, 1, 1])), "x"),
    (lambda: pad_to_packed(torch.zeros(2, 3), torch.tensor([1, 4])), "lengths"),
    (lambda: pad_to_packed(torch.zeros(2, 3), torch.tensor([1, -1])), "lengths"),
    (lambda: pad_to_packed(torch.zeros(2, 3), torch.tensor([1])), "lengths"),
    (lambda: pad_to_packed(torch.zeros(2, 3), torch.tensor([1.0, 2.0])), "lengths"),
    (lambda: packed_to_padded(torch.zeros(3), torch.tensor([1, 3])), "offsets"),
    (lambda: packed_to_padded(torch.zeros(3), torch.tensor([0, 2])), "offsets"),
    (lambda: packed_to_padded(torch.zeros(3), torch.tensor([0, 2, 1, 3])), "offsets"),
    (lambda: packed_to_padded(torch.zeros(3), torch.tensor([0, 3]), 2), "width"),
    (lambda: nested_to_padded(torch.zeros(2, 3)), "nt"),
    (lambda: nested_to_packed(torch.nested.nested_tensor_from_jagged(
        torch.zeros(4), offsets=torch.tensor([0, 2, 4]), lengths=torch.tensor([1, 2]))), "nt"),
])
def test_invalid_arguments_name_the_argument(call, key):
    with pytest.raises(InputError) as err:
        call()
    assert err.value.key == key and key in str(err.value)
