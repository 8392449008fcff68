"""Clipped value loss: hand-worked numbers, a naive loop, masked values."""

from __future__ import annotations

import pytest
import torch

from rlaudit.algo.value_loss import value_loss
from rlaudit.errors import InputError

F64 = torch.float64


def run(vpreds, values, returns, mask=None, c=0.5):
    v = torch.as_tensor(vpreds, dtype=F64).clone().requires_grad_(True)
    values, returns = torch.as_tensor(values, dtype=F64), torch.as_tensor(returns, dtype=F64)
    mask = torch.ones_like(values, dtype=torch.bool) if mask is None else mask
    loss, clipped = value_loss(v, values, returns, mask, cliprange_value=c)
    (grad,) = torch.autograd.grad(loss.sum(), v)
    return loss, clipped, grad


def test_hand_worked():
    # c = 0.5. Columns:
    # 0: v=2.0, V=1.0, G=0.0: clip(v)=1.5; (2-0)^2=4 vs (1.5-0)^2=2.25 -> 0.5*4=2, unclipped
    # 1: v=2.0, V=1.0, G=3.0: (2-3)^2=1 vs (1.5-3)^2=2.25 -> 0.5*2.25=1.125, clipped, grad 0
    # 2: v=1.2, V=1.0, G=3.0: inside the window -> 0.5*(1.8)^2=1.62, grad v-G=-1.8
    # 3: v=-1.0, V=0.0, G=0.5: clip(v)=-0.5; (1.5)^2=2.25 vs (1.0)^2=1 -> 1.125, grad -1.5
    loss, clipped, grad = run([[2.0, 2.0, 1.2, -1.0]], [[1.0, 1.0, 1.0, 0.0]],
                              [[0.0, 3.0, 3.0, 0.5]])
    assert loss[0].tolist() == pytest.approx([2.0, 1.125, 1.62, 1.125], abs=1e-12)
    assert clipped[0].tolist() == [False, True, False, False]
    assert grad[0].tolist() == pytest.approx([2.0, 0.0, -1.8, -1.5], abs=1e-12)


@pytest.mark.parametrize("seed", range(3))
def test_matches_naive_loop(seed):
    g = torch.Generator().manual_seed(seed)
    values = torch.randn(4, 5, generator=g, dtype=F64)
    vpreds = values + torch.randn(4, 5, generator=g, dtype=F64)
    returns = torch.randn(4, 5, generator=g, dtype=F64) * 2
    mask = torch.rand(4, 5, generator=g) < 0.7
    c = 0.3
    loss, clipped, grad = run(vpreds, values, returns, mask, c)
    for i in range(4):
        for t in range(5):
            if not mask[i, t]:
                assert loss[i, t].item() == 0.0 and not clipped[i, t] and grad[i, t] == 0.0
                continue
            v, old, ret = float(vpreds[i, t]), float(values[i, t]), float(returns[i, t])
            vc = min(max(v, old - c), old + c)
            a, b = (v - ret) ** 2, (vc - ret) ** 2
            assert loss[i, t].item() == pytest.approx(0.5 * max(a, b), abs=1e-12)
            assert clipped[i, t].item() is (b > a)
            inside = old - c < v < old + c
            d = (v - ret) if a >= b else ((vc - ret) if inside else 0.0)
            assert grad[i, t].item() == pytest.approx(d, abs=1e-12)


def test_values_under_mask_do_not_matter():
    mask = torch.tensor([[True, False, True]])
    nan = float("nan")
    clean = run([[1.0, 2.0, 3.0]], [[0.5, 1.0, 2.0]], [[0.0, 1.0, 1.0]], mask)
    dirty = run([[1.0, float("inf"), 3.0]], [[0.5, nan, 2.0]], [[0.0, nan, 1.0]], mask)
    for a, b in zip(clean, dirty):
        assert torch.equal(a, b)


def test_errors():
    x = torch.zeros(2, 3)
    with pytest.raises(InputError, match="returns"):
        value_loss(x, x, x[:, :2], x.bool(), cliprange_value=0.2)
    with pytest.raises(InputError, match="cliprange_value"):
        value_loss(x, x, x, x.bool(), cliprange_value=-1.0)
