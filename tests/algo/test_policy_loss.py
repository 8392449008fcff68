"""Policy losses: hand-worked clip regions, on-policy identities, naive loops, masked values."""

from __future__ import annotations

import math

import pytest
import torch

from rlaudit.algo.policy_loss import POLICY_LOSSES, compute_policy_loss
from rlaudit.errors import InputError, UnknownNameError

F64 = torch.float64
CLIP = dict(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0)


def run(name, old, logp, adv, mask=None, **clip):
    old, adv = torch.as_tensor(old, dtype=F64), torch.as_tensor(adv, dtype=F64)
    logp = torch.as_tensor(logp, dtype=F64).clone().requires_grad_(True)
    mask = torch.ones_like(old, dtype=torch.bool) if mask is None else mask
    out = compute_policy_loss(name, old_log_prob=old, log_prob=logp, advantages=adv, mask=mask,
                              **{**CLIP, **clip})
    (grad,) = torch.autograd.grad(out.loss_mat.sum(), logp)
    return out, grad


# (A, ratio) -> (loss, clipped, clipped_lower, d loss / d logp), eps = (0.2, 0.28), c = 3,
# worked by hand from max(-A r, -A clip(r, 0.8, 1.28)) and, for A < 0, min(., -3 A).
VANILLA_CASES = [
    (1.0, 1.5, -1.28, True, False, 0.0),     # A>0, above 1+high: clipped, no gradient
    (1.0, 0.5, -0.5, False, False, -0.5),    # A>0, below 1-low: unclipped (pessimistic side)
    (1.0, 1.1, -1.1, False, False, -1.1),    # inside the band
    (2.0, 0.7, -1.4, False, False, -1.4),
    (-1.0, 0.5, 0.8, True, False, 0.0),      # A<0, below 1-low: clipped
    (-1.0, 0.7, 0.8, True, False, 0.0),
    (-1.0, 1.5, 1.5, False, False, 1.5),     # A<0, above 1+high: unclipped, below the cap 3
    (-1.0, 4.0, 3.0, False, True, 0.0),      # dual clip: 4 > c = 3
    (-2.0, 3.5, 6.0, False, True, 0.0),      # dual clip: 7 > 6
    (0.0, 2.0, 0.0, False, False, 0.0),
]


@pytest.mark.parametrize("adv,ratio,loss,clipped,lower,grad", VANILLA_CASES)
def test_vanilla_hand_worked(adv, ratio, loss, clipped, lower, grad):
    old = [[-1.0]]
    out, g = run("vanilla", old, [[-1.0 + math.log(ratio)]], [[adv]])
    assert out.loss_mat.item() == pytest.approx(loss, abs=1e-12)
    assert out.clipped.item() is clipped and out.clipped_lower.item() is lower
    assert out.ratio.item() == pytest.approx(ratio, abs=1e-12)
    assert out.ppo_kl_mat.item() == pytest.approx(-math.log(ratio), abs=1e-12)
    assert g.item() == pytest.approx(grad, abs=1e-12)


def test_vanilla_log_ratio_clamp():
    out, g = run("vanilla", [[-40.0, -40.0]], [[-5.0, -5.0]], [[1.0, -1.0]])
    assert torch.isfinite(out.loss_mat).all()
    assert out.loss_mat[0].tolist() == pytest.approx([-1.28, 3.0])
    assert out.ratio[0, 0].item() == pytest.approx(math.exp(20.0))
    assert out.ppo_kl_mat[0, 0].item() == -20.0
    assert g.tolist() == [[0.0, 0.0]]


def naive_vanilla(old, logp, adv, low, high, c):
    """Per-token loop: value and d/dlogp of PPO clip + dual clip (no ties in random data)."""
    vals, grads = [], []
    for o, lp, a in zip(old, logp, adv):
        r = math.exp(lp - o)
        l1, l2 = -a * r, -a * min(max(r, 1 - low), 1 + high)
        if l2 > l1:
            val, d = l2, 0.0                      # clipped term is flat in r
        else:
            val, d = l1, -a * r
        if a < 0 and val > -a * c:
            val, d = -a * c, 0.0
        vals.append(val)
        grads.append(d)
    return vals, grads


@pytest.mark.parametrize("seed", range(3))
def test_vanilla_matches_naive_loop(seed):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(4, 6, generator=g, dtype=F64) * 3
    logp = old + torch.randn(4, 6, generator=g, dtype=F64) * 0.8
    adv = torch.randn(4, 6, generator=g, dtype=F64)
    out, grad = run("vanilla", old, logp, adv, clip_ratio_low=0.1, clip_ratio_high=0.3,
                    clip_ratio_c=2.0)
    vals, grads = naive_vanilla(old.flatten().tolist(), logp.flatten().tolist(),
                                adv.flatten().tolist(), 0.1, 0.3, 2.0)
    assert out.loss_mat.flatten().tolist() == pytest.approx(vals, abs=1e-12)
    assert grad.flatten().tolist() == pytest.approx(grads, abs=1e-12)


@pytest.mark.parametrize("name", ["vanilla", "gspo", "cispo"])
def test_on_policy_identity(name):
    g = torch.Generator().manual_seed(7)
    logp = -torch.rand(3, 5, generator=g, dtype=F64) * 4
    adv = torch.randn(3, 5, generator=g, dtype=F64)
    mask = torch.rand(3, 5, generator=g) < 0.7
    out, grad = run(name, logp.clone(), logp, adv, mask)
    assert torch.equal(out.ratio, torch.ones_like(out.ratio))
    assert not out.clipped.any() and not out.clipped_lower.any()
    assert torch.equal(out.ppo_kl_mat, torch.zeros_like(logp))
    expected_loss = -adv * (logp if name == "cispo" else 1.0)
    torch.testing.assert_close(out.loss_mat, torch.where(mask, expected_loss, 0.0), rtol=0,
                               atol=1e-15)
    torch.testing.assert_close(grad, torch.where(mask, -adv, 0.0), rtol=0, atol=1e-15)


def test_gspo_hand_worked():
    ln2 = math.log(2)
    old = torch.tensor([[-1.0, -2.0, -1.0], [-1.0, -1.0, -3.0]], dtype=F64)
    delta = torch.tensor([[ln2, 0.0, 9.0], [0.1, -0.1, 5.0]], dtype=F64)   # [.,2] is masked
    mask = torch.tensor([[True, True, False], [True, True, False]])
    adv = torch.tensor([[1.0, 1.0, 1.0], [-1.0, 2.0, 0.0]], dtype=F64)
    out, grad = run("gspo", old, old + delta, adv, mask, clip_ratio_low=0.2, clip_ratio_high=0.2)
    # row 0: s = exp(ln2 / 2) = sqrt 2 > 1.2 with A > 0 -> clipped at -1.2, no gradient
    # row 1: s = exp(0) = 1 -> loss -A, gradient -A * s
    expect = torch.tensor
    torch.testing.assert_close(out.loss_mat, expect([[-1.2, -1.2, 0.0], [1.0, -2.0, 0.0]],
                                                    dtype=F64), rtol=0, atol=1e-12)
    assert out.clipped.tolist() == [[True, True, False], [False, False, False]]
    assert out.ratio[0, :2].tolist() == pytest.approx([math.sqrt(2)] * 2)
    torch.testing.assert_close(grad, expect([[0.0, 0.0, 0.0], [1.0, -2.0, 0.0]], dtype=F64),
                               rtol=0, atol=1e-12)
    torch.testing.assert_close(out.ppo_kl_mat, expect([[-ln2, 0.0, 0.0], [-0.1, 0.1, 0.0]],
                                                      dtype=F64), rtol=0, atol=1e-12)


@pytest.mark.parametrize("seed", range(3))
def test_gspo_equals_vanilla_on_the_sequence_ratio(seed):
    g = torch.Generator().manual_seed(seed)
    b, r, low, high = 5, 6, 0.1, 0.15
    old = -torch.rand(b, r, generator=g, dtype=F64) * 3
    logp = old + torch.randn(b, r, generator=g, dtype=F64) * 0.3
    adv = torch.randn(b, 1, generator=g, dtype=F64).expand(b, r).clone()
    mask = torch.rand(b, r, generator=g) < 0.7
    mask[0] = False                                                    # an empty row
    out, grad = run("gspo", old, logp, adv, mask, clip_ratio_low=low, clip_ratio_high=high)
    for i in range(b):
        valid = [t for t in range(r) if mask[i, t]]
        mean = sum(float(logp[i, t] - old[i, t]) for t in valid) / max(len(valid), 1)
        s = math.exp(mean)
        for t in range(r):
            if t not in valid:
                assert out.loss_mat[i, t].item() == 0.0 and grad[i, t].item() == 0.0
                continue
            a = float(adv[i, t])
            l1, l2 = -a * s, -a * min(max(s, 1 - low), 1 + high)
            assert out.loss_mat[i, t].item() == pytest.approx(max(l1, l2), abs=1e-12)
            assert out.clipped[i, t].item() is (l2 > l1)
            # GSPO-token: the token's gradient is s_i * d logp_t through the unclipped term
            assert grad[i, t].item() == pytest.approx(0.0 if l2 > l1 else -a * s, abs=1e-12)
            assert out.ratio[i, t].item() == pytest.approx(s, abs=1e-12)


def test_cispo_hand_worked():
    ln = math.log
    old = [[-1.0, -1.0, -1.0]]
    logp = [[-1.0 + ln(1.5), -1.0 + ln(0.5), -1.0 + ln(1.1)]]
    adv = [[1.0, -2.0, 3.0]]
    out, grad = run("cispo", old, logp, adv)
    w = [1.28, 0.8, 1.1]                                 # clip(r, 0.8, 1.28)
    expected = [-w[k] * adv[0][k] * logp[0][k] for k in range(3)]
    assert out.loss_mat[0].tolist() == pytest.approx(expected, abs=1e-12)
    assert grad[0].tolist() == pytest.approx([-w[k] * adv[0][k] for k in range(3)], abs=1e-12)
    assert out.clipped[0].tolist() == [True, True, False]
    assert not out.clipped_lower.any()


@pytest.mark.parametrize("name", ["vanilla", "gspo", "cispo"])
def test_values_under_mask_do_not_matter(name):
    g = torch.Generator().manual_seed(3)
    old = -torch.rand(3, 4, generator=g, dtype=F64) * 2
    logp = old + torch.randn(3, 4, generator=g, dtype=F64) * 0.5
    adv = torch.randn(3, 4, generator=g, dtype=F64)
    mask = torch.tensor([[1, 1, 0, 0], [1, 0, 1, 0], [0, 0, 0, 0]])
    clean, clean_grad = run(name, old, logp, adv, mask)
    bad = mask == 0
    poison = torch.tensor(float("nan"), dtype=F64)
    dirty, dirty_grad = run(name, torch.where(bad, poison, old),
                            torch.where(bad, torch.tensor(float("inf"), dtype=F64), logp),
                            torch.where(bad, poison, adv), mask)
    for field in ("loss_mat", "clipped", "clipped_lower", "ratio", "ppo_kl_mat"):
        assert torch.equal(getattr(clean, field), getattr(dirty, field)), field
    assert torch.equal(clean_grad, dirty_grad)
    assert (clean.loss_mat[bad] == 0).all() and (clean.ratio[bad] == 1).all()


def test_outputs_do_not_alias_or_mutate_inputs():
    old = torch.tensor([[-1.0, -2.0]], dtype=F64)
    logp = torch.tensor([[-1.0, -2.0]], dtype=F64)
    adv = torch.tensor([[1.0, -1.0]], dtype=F64)
    mask = torch.ones(1, 2, dtype=torch.bool)
    copies = [x.clone() for x in (old, logp, adv, mask)]
    for name in POLICY_LOSSES.names():
        out = compute_policy_loss(name, old_log_prob=old, log_prob=logp, advantages=adv,
                                  mask=mask, **CLIP)
        for field in (out.loss_mat, out.ratio, out.ppo_kl_mat, out.clipped):
            field.zero_()
        assert all(torch.equal(a, b) for a, b in zip((old, logp, adv, mask), copies))


def test_errors():
    x = torch.zeros(1, 2, dtype=F64)
    m = torch.ones(1, 2, dtype=torch.bool)
    with pytest.raises(UnknownNameError, match="cispo, gspo, vanilla"):
        compute_policy_loss("ppo", old_log_prob=x, log_prob=x, advantages=x, mask=m, **CLIP)
    with pytest.raises(InputError, match="advantages"):
        compute_policy_loss("vanilla", old_log_prob=x, log_prob=x, advantages=x[:, :1], mask=m,
                            **CLIP)
    with pytest.raises(InputError, match="clip_ratio_c"):
        compute_policy_loss("vanilla", old_log_prob=x, log_prob=x, advantages=x, mask=m,
                            **{**CLIP, "clip_ratio_c": 1.0})
    with pytest.raises(InputError, match="clip_ratio_low"):
        compute_policy_loss("vanilla", old_log_prob=x, log_prob=x, advantages=x, mask=m,
                            **{**CLIP, "clip_ratio_low": -0.1})


def test_gspo_sequence_gradient_hand_worked():
    """gspo_gradient="sequence" (GSPO, eq. 7; slime, TRL): same values as GSPO-token, the
    gradient through the sequence mean. One row, valid log-ratios 0.1 and -0.3 (masked third
    token), A = (1, 3): s = exp(-0.1) inside the band (0.8, 1.2), loss_t = -A_t * s.
    Per-token: d loss_t / d logp_t = -A_t * s. Sequence: d (sum_t loss_t) / d logp_t' =
    -(A_1 + A_2) * s / 2 for both valid t'."""
    old = torch.tensor([[-1.0, -2.0, -1.0]], dtype=F64)
    logp = old + torch.tensor([[0.1, -0.3, 7.0]], dtype=F64)
    adv = torch.tensor([[1.0, 3.0, 5.0]], dtype=F64)
    mask = torch.tensor([[True, True, False]])
    s = math.exp(-0.1)
    tok, g_tok = run("gspo", old, logp, adv, mask, clip_ratio_low=0.2, clip_ratio_high=0.2)
    seq, g_seq = run("gspo", old, logp, adv, mask, clip_ratio_low=0.2, clip_ratio_high=0.2,
                     gspo_gradient="sequence")
    for out in (tok, seq):
        assert out.loss_mat.tolist()[0] == pytest.approx([-s, -3 * s, 0.0], abs=1e-12)
        assert out.ratio.tolist()[0] == pytest.approx([s, s, 1.0], abs=1e-12)
    assert g_tok.tolist()[0] == pytest.approx([-s, -3 * s, 0.0], abs=1e-12)
    assert g_seq.tolist()[0] == pytest.approx([-2 * s, -2 * s, 0.0], abs=1e-12)
    # equal advantages in a row: the two gradients agree
    eq = torch.full_like(adv, 2.0)
    _, a = run("gspo", old, logp, eq, mask, clip_ratio_low=0.2, clip_ratio_high=0.2)
    _, b = run("gspo", old, logp, eq, mask, clip_ratio_low=0.2, clip_ratio_high=0.2,
               gspo_gradient="sequence")
    torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
    with pytest.raises(InputError, match="gspo_gradient"):
        run("gspo", old, logp, adv, mask, gspo_gradient="mean")
