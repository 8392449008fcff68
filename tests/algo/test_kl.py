"""KL estimators: hand-worked values, sign, unbiasedness under sampling, straight-through grads."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from rlaudit.algo.kl import KL_ESTIMATORS, kl_penalty
from rlaudit.algo.policy_loss import importance_ratio
from rlaudit.errors import InputError, UnknownNameError

F64 = torch.float64


def t(*values):
    return torch.tensor([list(values)], dtype=F64)


# logp = log 0.5, ref = log 0.25  ->  logp - ref = log 2,  ref - logp = -log 2
LOGP, REF = math.log(0.5), math.log(0.25)
HAND = {
    "k1": math.log(2),
    "kl": math.log(2),
    "abs": math.log(2),
    "k2": 0.5 * math.log(2) ** 2,
    "mse": 0.5 * math.log(2) ** 2,
    "k3": 0.5 + math.log(2) - 1,          # e^{-log 2} - (-log 2) - 1
    "low_var_kl": 0.5 + math.log(2) - 1,
    "k1+": math.log(2),
    "kl+": math.log(2),
    "k3+": 0.5 + math.log(2) - 1,
    "low_var_kl+": 0.5 + math.log(2) - 1,
}


def test_registry_has_exactly_the_documented_names():
    assert KL_ESTIMATORS.names() == sorted(HAND)


@pytest.mark.parametrize("kind", sorted(HAND))
def test_hand_worked_values(kind):
    out = kl_penalty(t(LOGP, 0.0), t(REF, 0.0), kind)
    assert out.shape == (1, 2)
    assert out[0, 0].item() == pytest.approx(HAND[kind], abs=1e-15)
    assert out[0, 1].item() == 0.0                      # equal log-probs -> 0 for every estimator


def test_abs_and_k1_sign():
    out1 = kl_penalty(t(REF), t(LOGP), "k1")
    assert out1.item() == pytest.approx(-math.log(2), abs=1e-15)
    assert kl_penalty(t(REF), t(LOGP), "abs").item() == pytest.approx(math.log(2), abs=1e-15)
    # k3 with logp < ref: d = log 2 -> 2 - log 2 - 1
    assert kl_penalty(t(REF), t(LOGP), "k3").item() == pytest.approx(1 - math.log(2), abs=1e-15)


def test_k3_clamps():
    # ref - logp = 50 is clamped to 20 before exp, then the value is capped at 10.
    assert kl_penalty(t(-50.0), t(0.0), "k3").item() == 10.0
    # ref - logp = -50 -> d = -20: e^-20 + 20 - 1 = 19.000000002 -> capped at 10.
    assert kl_penalty(t(0.0), t(-50.0), "k3").item() == 10.0
    # Just below the cap: d = 2.5 -> e^2.5 - 3.5 = 8.68...
    assert kl_penalty(t(0.0), t(2.5), "k3").item() == pytest.approx(math.exp(2.5) - 3.5, abs=1e-12)
    out = kl_penalty(t(-1e4), t(0.0), "k3")
    assert torch.isfinite(out).all()


@given(st.lists(st.floats(-30, 30), min_size=1, max_size=20),
       st.lists(st.floats(-30, 30), min_size=1, max_size=20))
def test_k3_is_non_negative(a, b):
    n = min(len(a), len(b))
    out = kl_penalty(torch.tensor([a[:n]], dtype=F64), torch.tensor([b[:n]], dtype=F64), "k3")
    assert (out >= 0).all()


@pytest.mark.parametrize("kind", ["k1", "k3"])
def test_unbiased_under_sampling(kind):
    """E_{x~p}[estimator(log p(x), log q(x))] = KL(p || q) for k1 and k3 (Monte-Carlo)."""
    p = torch.tensor([0.5, 0.3, 0.15, 0.05], dtype=F64)
    q = torch.tensor([0.25, 0.25, 0.25, 0.25], dtype=F64)
    true_kl = sum(pi * math.log(pi / qi) for pi, qi in zip(p.tolist(), q.tolist()))
    g = torch.Generator().manual_seed(1234)
    x = torch.multinomial(p, 200_000, replacement=True, generator=g)
    est = kl_penalty(p.log()[x].unsqueeze(0), q.log()[x].unsqueeze(0), kind).mean().item()
    assert est == pytest.approx(true_kl, abs=0.01)      # true KL ~ 0.20; MC s.e. ~ 0.002


def test_k2_is_biased_but_close_for_near_policies():
    p = torch.tensor([0.3, 0.7], dtype=F64)
    q = torch.tensor([0.31, 0.69], dtype=F64)
    true_kl = sum(pi * math.log(pi / qi) for pi, qi in zip(p.tolist(), q.tolist()))
    exact_k2 = sum(pi * 0.5 * math.log(pi / qi) ** 2 for pi, qi in zip(p.tolist(), q.tolist()))
    out = kl_penalty(p.log().unsqueeze(0), q.log().unsqueeze(0), "k2")
    assert (out[0] * p).sum().item() == pytest.approx(exact_k2, abs=1e-15)
    assert exact_k2 == pytest.approx(true_kl, rel=0.05)


@pytest.mark.parametrize("kind,base", [("k1+", "k1"), ("kl+", "k1"), ("k3+", "k3"),
                                        ("low_var_kl+", "k3")])
def test_straight_through_value_of_base_gradient_of_k2(kind, base):
    g = torch.Generator().manual_seed(5)
    logp = (torch.randn(3, 4, generator=g, dtype=F64) - 2).requires_grad_(True)
    ref = torch.randn(3, 4, generator=g, dtype=F64) - 2
    out = kl_penalty(logp, ref, kind)
    torch.testing.assert_close(out, kl_penalty(logp, ref, base), rtol=0, atol=0)
    w = torch.randn(3, 4, generator=g, dtype=F64)
    (grad,) = torch.autograd.grad((out * w).sum(), logp)
    # d/dlogp 0.5 (logp - ref)^2 = logp - ref, computed by hand
    torch.testing.assert_close(grad, w * (logp.detach() - ref), rtol=0, atol=1e-15)


def test_gradients_of_plain_estimators():
    logp = torch.tensor([[-1.0, -2.0]], dtype=F64, requires_grad=True)
    ref = torch.tensor([[-1.5, -1.0]], dtype=F64)
    expected = {
        "k1": [1.0, 1.0],
        "abs": [1.0, -1.0],
        "k2": [0.5, -1.0],
        # d/dlogp [e^{ref-logp} - (ref-logp) - 1] = -e^{ref-logp} + 1
        "k3": [1 - math.exp(-0.5), 1 - math.exp(1.0)],
    }
    for kind, exp in expected.items():
        (grad,) = torch.autograd.grad(kl_penalty(logp, ref, kind).sum(), logp)
        assert grad[0].tolist() == pytest.approx(exp, abs=1e-15), kind


def test_output_is_new_tensor_and_inputs_untouched():
    logp, ref = t(-1.0, -2.0), t(-1.0, -3.0)
    before = (logp.clone(), ref.clone())
    for kind in KL_ESTIMATORS.names():
        out = kl_penalty(logp, ref, kind)
        out.add_(1.0)                                   # writing to the output ...
        assert torch.equal(logp, before[0]) and torch.equal(ref, before[1])  # ... is harmless


def test_errors():
    with pytest.raises(UnknownNameError, match="valid: abs, k1"):
        kl_penalty(t(0.0), t(0.0), "k4")
    with pytest.raises(InputError, match="ref_log_prob"):
        kl_penalty(t(0.0, 1.0), t(0.0), "k1")


def test_k3_without_its_value_clamp():
    """k3_clamp="none" (TRL, textbook k3): exp(d) - d - 1 past 10, by hand; the same below it;
    k3+ keeps k2's gradient; other estimators are untouched; an unknown value is an input
    error."""
    logp = torch.tensor([[-4.0, -1.0, -0.5]], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([[-1.0, -1.2, -30.0]], dtype=torch.float64)   # d = 3, -0.2, -29.5
    want = [math.exp(3) - 3 - 1, math.exp(-0.2) + 0.2 - 1, math.exp(-20) + 20 - 1]
    for kind in ("k3", "low_var_kl", "k3+", "low_var_kl+"):
        got = kl_penalty(logp, ref, kind, k3_clamp="none")
        assert got.detach()[0].tolist() == pytest.approx(want, rel=1e-12), kind
        clamped = kl_penalty(logp, ref, kind)
        assert clamped.detach()[0].tolist() == pytest.approx([10.0, want[1], 10.0], rel=1e-12)
    (g,) = torch.autograd.grad(kl_penalty(logp, ref, "k3+", k3_clamp="none").sum(), logp)
    assert g[0].tolist() == pytest.approx((logp - ref).detach()[0].tolist())   # k2's gradient
    for kind in ("k1", "k2", "abs", "k1+"):
        assert torch.equal(kl_penalty(logp, ref, kind, k3_clamp="none"),
                           kl_penalty(logp, ref, kind))
    with pytest.raises(InputError, match="k3_clamp"):
        kl_penalty(logp, ref, "k3", k3_clamp="value-20")


# ---- the KL term times the importance ratio (kl_loss_weight="ratio", TRL's bias correction) ----

def test_importance_ratio_token_level_hand_worked():
    """Two valid tokens and a masked one (NaN there must not leak). k3 times the ratio: the value
    is ratio * k3 and the gradient w.r.t. logp is ratio * (logp - ref), worked by hand:
    d/dx [e^(x-o) (e^(r-x) - (r-x) - 1)] = e^(x-o) (k3 + 1 - e^(r-x)) = e^(x-o) (x - r)."""
    x = torch.tensor([[-1.0, -2.0, -0.5]], dtype=torch.float64, requires_grad=True)
    old = torch.tensor([[-1.5, -2.0, float("nan")]], dtype=torch.float64)
    ref = torch.tensor([[-1.2, -1.0, -0.5]], dtype=torch.float64)
    mask = torch.tensor([[True, True, False]])
    w = importance_ratio(x, old, mask)
    assert w.detach()[0].tolist() == pytest.approx([math.exp(0.5), 1.0, 1.0], rel=1e-15)
    term = kl_penalty(x, ref, "k3", k3_clamp="none") * w
    k3 = [math.exp(-0.2) + 0.2 - 1, math.exp(1.0) - 1.0 - 1]
    assert term[0, :2].tolist() == pytest.approx([math.exp(0.5) * k3[0], k3[1]], rel=1e-14)
    (term * mask).sum().backward()
    assert x.grad[0].tolist() == pytest.approx([math.exp(0.5) * 0.2, -1.0, 0.0], rel=1e-14)


def test_importance_ratio_sequence_level_hand_worked():
    """GSPO's level: every valid token of a row gets exp of the row's mean log-ratio, and the
    gradient flows through that mean. Row 0: log-ratios 0.4 and -0.2 -> s = e^0.1 on both;
    d/dx_j sum_t s * c_t = s * (c_0 + c_1) / 2 for constant c. Row 1 has no valid token: 1."""
    x = torch.tensor([[-1.0, -2.0], [-1.0, -1.0]], dtype=torch.float64, requires_grad=True)
    old = torch.tensor([[-1.4, -1.8], [0.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[True, True], [False, False]])
    w = importance_ratio(x, old, mask, sequence=True)
    s = math.exp(0.1)
    assert w.detach().flatten().tolist() == pytest.approx([s, s, 1.0, 1.0], rel=1e-14)
    c = torch.tensor([[3.0, 5.0], [7.0, 11.0]], dtype=torch.float64)
    (w * c * mask).sum().backward()
    assert x.grad.flatten().tolist() == pytest.approx([s * 4.0, s * 4.0, 0.0, 0.0], rel=1e-14)


def test_importance_ratio_rejects_mismatched_shapes():
    with pytest.raises(InputError, match="must equal log_prob.s shape"):
        importance_ratio(torch.zeros(2, 3), torch.zeros(2, 2), torch.ones(2, 3, dtype=torch.bool))
