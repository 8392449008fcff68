"""Rollout IS weights, rollout KL loss and mismatch metrics vs naive loops and identities."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from rlaudit.algo.rollout_corr import (MAX_LOG_RATIO, is_metrics, mismatch_metrics,
                                       rollout_is_weights, rollout_kl_loss_mat)
from rlaudit.errors import InputError
from rlaudit.metrics import CATALOGUE

F64 = torch.float64


def _batch():
    old = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -0.7, float("nan")], [0.0, 0.0, 0.0]], dtype=F64)
    rollout = torch.tensor([[-1.5, -1.0, -0.5], [-0.2, -0.7, -9.0], [1.0, 2.0, 3.0]], dtype=F64)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [0, 0, 0]], dtype=torch.bool)
    return old, rollout, mask


def test_token_level_hand_worked():
    old, rollout, mask = _batch()
    w, trunc = rollout_is_weights(old, rollout, mask, level="token", threshold=1.5)
    # log-ratios: row 0: 0.5, -1, 0 -> exp(0.5)=1.6487 > 1.5 truncated; row 1: -0.1, 0
    expect = torch.tensor([[1.5, math.exp(-1), 1.0], [math.exp(-0.1), 1.0, 0], [0, 0, 0]],
                          dtype=F64)
    assert torch.allclose(w, expect, atol=1e-15, rtol=0)
    assert trunc.tolist() == [[True, False, False], [False, False, False], [False] * 3]
    assert not w.requires_grad


def test_sequence_level_hand_worked():
    old, rollout, mask = _batch()
    w, trunc = rollout_is_weights(old, rollout, mask, level="sequence", threshold=2.0)
    # row 0: sum = 0.5 - 1 + 0 = -0.5; row 1: -0.1 (the NaN under mask 0 is never read)
    e0, e1 = math.exp(-0.5), math.exp(-0.1)
    expect = torch.tensor([[e0, e0, e0], [e1, e1, 0], [0, 0, 0]], dtype=F64)
    assert torch.allclose(w, expect, atol=1e-15, rtol=0)
    assert not trunc.any()
    w, trunc = rollout_is_weights(old, rollout, mask, level="sequence", threshold=0.8)
    # exp(-0.1) = 0.905 > 0.8: row 1 is truncated (only its valid tokens flagged); row 0 is not
    assert torch.allclose(w, torch.tensor([[e0] * 3, [0.8, 0.8, 0], [0] * 3], dtype=F64),
                          atol=1e-15, rtol=0)
    assert trunc.tolist() == [[False] * 3, [True, True, False], [False] * 3]


def test_identity_when_rollout_equals_old():
    lp = -torch.rand(4, 5, dtype=F64) * 3
    mask = torch.rand(4, 5) > 0.3
    for level in ("token", "sequence", "geometric"):
        w, trunc = rollout_is_weights(lp, lp.clone(), mask, level=level, threshold=2.0)
        assert torch.equal(w, mask.to(F64)) and not trunc.any()
    m = mismatch_metrics(lp, lp.clone(), mask)
    assert m == {"rollout_corr/kl": 0.0, "rollout_corr/k3_kl": 0.0,
                 "rollout_corr/log_ppl_diff": 0.0, "rollout_corr/max_abs_log_prob_diff": 0.0}
    for kind in ("k1", "abs", "k2", "k3"):
        assert torch.equal(rollout_kl_loss_mat(lp, lp.clone(), kind), torch.zeros_like(lp))


def test_no_overflow_and_no_truncation_when_threshold_none():
    old = torch.tensor([[0.0, 0.0]], dtype=torch.float32)
    rollout = torch.tensor([[-500.0, -1.0]], dtype=torch.float32)
    mask = torch.ones(1, 2, dtype=torch.bool)
    w, trunc = rollout_is_weights(old, rollout, mask, level="token", threshold=None)
    assert torch.isfinite(w).all() and not trunc.any()
    assert w[0, 0].item() == pytest.approx(math.exp(MAX_LOG_RATIO), rel=1e-6)
    w, _ = rollout_is_weights(old, rollout, mask, level="sequence", threshold=None)
    assert torch.isfinite(w).all()


@st.composite
def pairs(draw):
    b, r = draw(st.integers(1, 5)), draw(st.integers(1, 5))
    lp = st.floats(-4, 0, allow_nan=False, width=64)
    old = torch.tensor(draw(st.lists(lp, min_size=b * r, max_size=b * r)), dtype=F64).view(b, r)
    rollout = torch.tensor(draw(st.lists(lp, min_size=b * r, max_size=b * r)), dtype=F64).view(b, r)
    mask = torch.tensor(draw(st.lists(st.booleans(), min_size=b * r, max_size=b * r))).view(b, r)
    return old, rollout, mask


def test_geometric_level_hand_worked():
    old, rollout, mask = _batch()
    w, trunc = rollout_is_weights(old, rollout, mask, level="geometric", threshold=0.9)
    # row 0: mean log-ratio (0.5 - 1 + 0) / 3 = -1/6; row 1: (-0.1 + 0) / 2 = -0.05 ->
    # exp(-0.05) = 0.9512 > 0.9: truncated; the sequence level would give exp(-0.5), exp(-0.1)
    e0 = math.exp(-1 / 6)
    expect = torch.tensor([[e0] * 3, [0.9, 0.9, 0], [0] * 3], dtype=F64)
    assert torch.allclose(w, expect, atol=1e-15, rtol=0)
    assert trunc.tolist() == [[False] * 3, [True, True, False], [False] * 3]
    assert is_metrics(w, trunc, mask, level="geometric") == pytest.approx(
        {"rollout_corr/is_weight_mean": (3 * e0 + 2 * 0.9) / 5,
         "rollout_corr/is_clipfrac": 1 / 2}, abs=1e-15)


def test_mask_mode_hand_worked():
    old, rollout, mask = _batch()
    # token ratios: exp(0.5) = 1.65, exp(-1) = 0.37, 1, exp(-0.1) = 0.905, 1; bounds [0.5, 1.5]
    w, out = rollout_is_weights(old, rollout, mask, level="token", threshold=1.5,
                                mode="mask", threshold_lower=0.5)
    expect = torch.tensor([[0.0, 0.0, 1.0], [math.exp(-0.1), 1.0, 0], [0] * 3], dtype=F64)
    assert torch.allclose(w, expect, atol=1e-15, rtol=0)
    assert out.tolist() == [[True, True, False], [False] * 3, [False] * 3]
    # default lower bound 1 / threshold = 0.8: the sequence weight exp(-0.5) = 0.61 of row 0 is
    # masked, exp(-0.1) of row 1 kept
    w, out = rollout_is_weights(old, rollout, mask, level="sequence", threshold=1.25, mode="mask")
    e1 = math.exp(-0.1)
    assert torch.allclose(w, torch.tensor([[0.0] * 3, [e1, e1, 0], [0] * 3], dtype=F64),
                          atol=1e-15, rtol=0)
    assert out.tolist() == [[True] * 3, [False] * 3, [False] * 3]


def test_levels_give_different_weights_and_bad_arguments_are_input_errors():
    old, rollout, mask = _batch()
    got = {lv: rollout_is_weights(old, rollout, mask, level=lv, threshold=None)[0][0, 0].item()
           for lv in ("token", "sequence", "geometric")}
    assert got == pytest.approx({"token": math.exp(0.5), "sequence": math.exp(-0.5),
                                 "geometric": math.exp(-0.5 / 3)}, rel=1e-15)
    for kw, key in ((dict(level="seq"), "rollout_is"), (dict(mode="clip"), "rollout_is_mode"),
                    (dict(mode="mask", threshold=None), "rollout_is_threshold"),
                    (dict(mode="mask", threshold_lower=3.0), "rollout_is_threshold_lower")):
        args = dict(level="token", threshold=2.0) | kw
        with pytest.raises(InputError) as e:
            rollout_is_weights(old, rollout, mask, **args)
        assert e.value.key.endswith(key)


@given(batch=pairs(), threshold=st.sampled_from([None, 0.5, 1.0, 2.0, 10.0]),
       level=st.sampled_from(["token", "sequence", "geometric"]),
       mode=st.sampled_from(["truncate", "mask"]))
def test_weights_match_naive(batch, threshold, level, mode):
    old, rollout, mask = batch
    if mode == "mask" and (threshold is None or threshold < 1):
        return  # mask mode needs an upper bound >= its default lower bound 1 / threshold
    w, trunc = rollout_is_weights(old, rollout, mask, level=level, threshold=threshold, mode=mode)
    b, r = old.shape
    for i in range(b):
        ds = [old[i, t].item() - rollout[i, t].item() for t in range(r) if mask[i, t]]
        for t in range(r):
            if not mask[i, t]:
                assert w[i, t].item() == 0.0 and not trunc[i, t]
                continue
            log_w = {"token": old[i, t].item() - rollout[i, t].item(), "sequence": sum(ds),
                     "geometric": sum(ds) / max(len(ds), 1)}[level]
            raw = math.exp(log_w)
            if threshold is None:
                cut, value = False, raw
            elif mode == "truncate":
                cut, value = raw > threshold, min(raw, threshold)
            else:
                cut = raw > threshold or raw < 1 / threshold
                value = 0.0 if cut else raw
            if threshold is not None and min(abs(raw - threshold), abs(raw - 1 / threshold)) \
                    <= 1e-12 * threshold:
                continue  # a tie: summation order may put the weight on either side
            assert bool(trunc[i, t]) == cut
            assert w[i, t].item() == pytest.approx(value, rel=1e-12)


@given(batch=pairs())
def test_mismatch_metrics_match_naive(batch):
    old, rollout, mask = batch
    got = mismatch_metrics(old, rollout, mask)
    assert set(got) <= set(CATALOGUE)
    toks = [(i, t) for i in range(old.shape[0]) for t in range(old.shape[1]) if mask[i, t]]
    d = {k: old[k].item() - rollout[k].item() for k in toks}
    n = len(toks)
    kl = sum(-x for x in d.values()) / n if n else 0.0
    k3 = sum(math.exp(x) - x - 1 for x in d.values()) / n if n else 0.0
    diffs = []
    for i in range(old.shape[0]):
        row = [(old[i, t].item(), rollout[i, t].item()) for t in range(old.shape[1]) if mask[i, t]]
        if row:   # train log-ppl - rollout log-ppl, log-ppl = -mean log-prob
            diffs.append(-sum(o for o, _ in row) / len(row) + sum(r for _, r in row) / len(row))
    assert got["rollout_corr/kl"] == pytest.approx(kl, abs=1e-12)
    assert got["rollout_corr/k3_kl"] == pytest.approx(k3, abs=1e-12)
    assert got["rollout_corr/log_ppl_diff"] == pytest.approx(
        sum(diffs) / len(diffs) if diffs else 0.0, abs=1e-12)
    assert got["rollout_corr/max_abs_log_prob_diff"] == pytest.approx(
        max((abs(x) for x in d.values()), default=0.0), abs=1e-15)


def test_mismatch_metrics_hand_worked():
    old, rollout, mask = _batch()
    got = mismatch_metrics(old, rollout, mask)
    # d = old - rollout on valid tokens: 0.5, -1, 0, -0.1, 0
    assert got["rollout_corr/kl"] == pytest.approx(0.6 / 5, abs=1e-15)
    k3 = sum(math.exp(x) - x - 1 for x in (0.5, -1.0, 0.0, -0.1, 0.0)) / 5
    assert got["rollout_corr/k3_kl"] == pytest.approx(k3, abs=1e-15)
    # row 0: mean rollout -1.0, mean old -3.5/3; row 1: mean rollout -0.45, mean old -0.5
    want = ((-1.0 + 3.5 / 3) + (-0.45 + 0.5)) / 2
    assert got["rollout_corr/log_ppl_diff"] == pytest.approx(want, abs=1e-15)
    assert got["rollout_corr/max_abs_log_prob_diff"] == 1.0


def test_is_metrics_hand_worked():
    old, rollout, mask = _batch()
    w, trunc = rollout_is_weights(old, rollout, mask, level="token", threshold=1.5)
    got = is_metrics(w, trunc, mask, level="token")
    assert set(got) <= set(CATALOGUE)
    mean = (1.5 + math.exp(-1) + 1 + math.exp(-0.1) + 1) / 5
    assert got == pytest.approx({"rollout_corr/is_weight_mean": mean,
                                 "rollout_corr/is_clipfrac": 1 / 5}, abs=1e-15)
    w, trunc = rollout_is_weights(old, rollout, mask, level="sequence", threshold=0.8)
    got = is_metrics(w, trunc, mask, level="sequence")
    assert got["rollout_corr/is_clipfrac"] == 0.5          # 1 of the 2 rows with valid tokens
    empty = torch.zeros_like(mask)
    assert is_metrics(w, trunc, empty, level="token") == {"rollout_corr/is_weight_mean": 0.0,
                                                          "rollout_corr/is_clipfrac": 0.0}


def test_rollout_kl_loss_mat_values_and_grad():
    lp = torch.tensor([[-1.0, -2.0, 5.0]], dtype=F64, requires_grad=True)
    rlp = torch.tensor([[-1.5, -1.0, float("nan")]], dtype=F64)
    mask = torch.tensor([[True, True, False]])
    loss = rollout_kl_loss_mat(lp, rlp, "k2", mask=mask)
    assert torch.allclose(loss, torch.tensor([[0.125, 0.5, 0.0]], dtype=F64), atol=0, rtol=0)
    loss.sum().backward()                       # d/dlp 0.5 (lp - rlp)^2 = lp - rlp
    assert torch.allclose(lp.grad, torch.tensor([[0.5, -1.0, 0.0]], dtype=F64), atol=0, rtol=0)
    k1 = rollout_kl_loss_mat(lp.detach(), rlp, "k1")
    assert k1[0, :2].tolist() == [0.5, -1.0]
    k3 = rollout_kl_loss_mat(lp.detach(), rlp, "k3", mask=mask)     # exp(r - l) - (r - l) - 1
    assert k3[0, 0].item() == pytest.approx(math.exp(-0.5) + 0.5 - 1, abs=1e-15)


def test_inputs_untouched():
    old, rollout, mask = _batch()
    ins = [old, rollout, mask]
    before = [(t.clone(), t._version) for t in ins]
    w, _ = rollout_is_weights(old, rollout, mask, level="sequence", threshold=2.0)
    mismatch_metrics(old, rollout, mask)
    for t, (copy, ver) in zip(ins, before):
        assert torch.allclose(t.double(), copy.double(), atol=0, rtol=0, equal_nan=True)
        assert t._version == ver
    assert w.untyped_storage().data_ptr() not in {t.untyped_storage().data_ptr() for t in ins}


def test_bad_inputs():
    old, rollout, mask = _batch()
    with pytest.raises(InputError, match="rollout_is"):
        rollout_is_weights(old, rollout, mask, level="seq", threshold=2.0)
    with pytest.raises(InputError, match="threshold"):
        rollout_is_weights(old, rollout, mask, level="token", threshold=0.0)
    with pytest.raises(InputError, match="rollout_log_probs"):
        rollout_is_weights(old, rollout[:, :2], mask, level="token", threshold=2.0)
    with pytest.raises(InputError, match="mask"):
        mismatch_metrics(old, rollout, mask.float() * 3)
