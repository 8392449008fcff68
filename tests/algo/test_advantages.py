"""Advantage estimators vs hand-worked numbers and naive per-row/per-group Python loops."""

from __future__ import annotations

import math
import statistics
from collections import defaultdict

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from rlaudit.algo.advantages import ADV_ESTIMATORS, GRPO_EPS, WHITEN_EPS, compute_advantages
from rlaudit.errors import InputError, UnknownNameError

F64 = torch.float64
NAMES = ["gae", "grpo", "drgrpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline"]


def run(name, r, m, uid, v=None, **kw):
    return compute_advantages(name, token_level_rewards=r, response_mask=m, uid=uid, values=v, **kw)


# ---- naive reference implementations (lists and dicts, explicit sums) -------------------------
def _valid(m, i):
    return [t for t in range(len(m[i])) if m[i][t]]


def _scores(r, m):
    return [sum(r[i][t] for t in _valid(m, i)) for i in range(len(r))]


def _groups(uid):
    g = defaultdict(list)
    for i, u in enumerate(uid):
        g[u].append(i)
    return g


def _whiten(x, m):
    """Naive masked whitening over all valid tokens (statistics.variance is Bessel-corrected)."""
    vals = [x[i][t] for i in range(len(x)) for t in _valid(m, i)]
    if not vals:
        return [[0.0] * len(row) for row in x]
    mu = sum(vals) / len(vals)
    var = statistics.variance(vals) if len(vals) > 1 else 0.0
    return [[(x[i][t] - mu) / math.sqrt(var + WHITEN_EPS) if m[i][t] else 0.0
             for t in range(len(x[i]))] for i in range(len(x))]


def _per_row(adv_row, m):
    return [[adv_row[i] if m[i][t] else 0.0 for t in range(len(m[i]))] for i in range(len(m))]


def naive(name, r, m, uid, v=None, gamma=1.0, lam=1.0, norm=True):
    r, m, uid = r.tolist(), m.tolist(), uid.tolist()
    v = v.tolist() if v is not None else None
    b = len(r)
    s = _scores(r, m)
    groups = _groups(uid)
    if name in ("grpo", "drgrpo"):
        norm = norm and name == "grpo"
        adv = []
        for i in range(b):
            rows = groups[uid[i]]
            if len(rows) == 1:
                mean, std = 0.0, 1.0
            else:
                t = torch.tensor([s[j] for j in rows], dtype=F64)
                mean, std = float(t.mean()), float(t.std())
            adv.append((s[i] - mean) / (std + GRPO_EPS) if norm else s[i] - mean)
        out = _per_row(adv, m)
        return out, out
    if name == "rloo":
        adv = []
        for i in range(b):
            others = [s[j] for j in groups[uid[i]] if j != i]
            adv.append(s[i] - sum(others) / len(others) if others else s[i])
        out = _per_row(adv, m)
        return out, out
    if name == "reinforce_plus_plus_baseline":
        adv = []
        for i in range(b):
            rows = groups[uid[i]]
            mean = sum(s[j] for j in rows) / len(rows) if len(rows) > 1 else 0.0
            adv.append(s[i] - mean)
        out = _whiten(_per_row(adv, m), m)
        return out, out
    # temporal estimators: explicit discounted sums over the row's valid tokens
    adv = [[0.0] * len(r[0]) for _ in range(b)]
    ret = [[0.0] * len(r[0]) for _ in range(b)]
    for i in range(b):
        idx = _valid(m, i)
        n = len(idx)
        if name == "gae":
            vals = [v[i][t] for t in idx] + [0.0]
            delta = [r[i][idx[k]] + gamma * vals[k + 1] - vals[k] for k in range(n)]
            for k in range(n):
                a = sum((gamma * lam) ** (l - k) * delta[l] for l in range(k, n))
                adv[i][idx[k]] = a
                ret[i][idx[k]] = a + vals[k]
        else:  # reinforce_plus_plus
            for k in range(n):
                g = sum(gamma ** (l - k) * r[i][idx[l]] for l in range(k, n))
                adv[i][idx[k]] = g
                ret[i][idx[k]] = g
    return _whiten(adv, m), ret


def close(a, b, atol=1e-8):
    assert torch.allclose(a, torch.as_tensor(b, dtype=a.dtype), atol=atol, rtol=0), (a, b)


# ---- hand-worked numbers ----------------------------------------------------------------------
def test_registry_names():
    assert ADV_ESTIMATORS.names() == sorted(NAMES)
    with pytest.raises(UnknownNameError, match="gpro.*valid: drgrpo, gae, grpo"):
        run("gpro", torch.zeros(1, 1, dtype=F64), torch.ones(1, 1, dtype=torch.bool),
            torch.zeros(1, dtype=torch.long))


def _outcome_batch():
    # group 7: rows 0 and 2 (scores 1 and 3), non-contiguous; group -3 and 100: singletons (2, 5).
    r = torch.tensor([[0, 0, 1.], [0, 2, 0], [0, 0, 3], [5, 0, 0]], dtype=F64)
    m = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 1, 1], [1, 0, 0]], dtype=torch.bool)
    return r, m, torch.tensor([7, -3, 7, 100])


def test_grpo_hand_worked():
    r, m, uid = _outcome_batch()
    adv, ret = run("grpo", r, m, uid)
    a = 1 / (math.sqrt(2) + GRPO_EPS)       # |1 - 2| / std([1, 3]) with std = sqrt(2)
    s1, s5 = 2 / (1 + GRPO_EPS), 5 / (1 + GRPO_EPS)   # singletons: mean 0, std 1
    close(adv, [[-a, -a, -a], [s1, s1, 0], [a, a, a], [s5, 0, 0]], atol=1e-12)
    assert torch.equal(adv, ret)


def test_grpo_without_std_and_drgrpo():
    r, m, uid = _outcome_batch()
    expect = [[-1, -1, -1], [2, 2, 0], [1, 1, 1], [5, 0, 0]]
    close(run("grpo", r, m, uid, norm_adv_by_std_in_grpo=False)[0], expect, atol=0)
    close(run("drgrpo", r, m, uid)[0], expect, atol=0)
    close(run("drgrpo", r, m, uid, norm_adv_by_std_in_grpo=True)[0], expect, atol=0)


def test_rloo_hand_worked():
    # group 0: scores 1, 2, 6 -> 1-(2+6)/2 = -3, 2-(1+6)/2 = -1.5, 6-(1+2)/2 = 4.5; singleton 5 -> 5
    r = torch.tensor([[1.], [2.], [6.], [5.]], dtype=F64)
    m = torch.ones(4, 1, dtype=torch.bool)
    adv, ret = run("rloo", r, m, torch.tensor([0, 0, 0, 9]))
    close(adv, [[-3], [-1.5], [4.5], [5]], atol=1e-12)
    assert torch.equal(adv, ret)


def test_gae_hand_worked_with_interior_gap():
    # valid tokens 0 and 2 (token 1 is tool output: its reward 99 and value 7 are skipped).
    # gamma = lam = 0.5: A_2 = 1 - 0.25 = 0.75; A_0 = (0 + 0.5*0.25 - 0.5) + 0.25*0.75 = -0.1875
    r = torch.tensor([[0, 99, 1.]], dtype=F64)
    v = torch.tensor([[0.5, 7, 0.25]], dtype=F64)
    m = torch.tensor([[True, False, True]])
    adv, ret = run("gae", r, m, torch.tensor([0]), v, gamma=0.5, lam=0.5)
    close(ret, [[0.3125, 0, 1.0]], atol=0)
    # whitening two values gives -+1/sqrt(2) (Bessel variance 2 * 0.46875^2)
    w = 0.46875 / math.sqrt(2 * 0.46875 ** 2 + WHITEN_EPS)
    close(adv, [[-w, 0, w]], atol=1e-12)


def test_reinforce_plus_plus_hand_worked():
    # gamma = 0.5: row 0 returns [1, 2, 4]; row 1 (one valid token) [2]
    r = torch.tensor([[0, 0, 4.], [2, 0, 0]], dtype=F64)
    m = torch.tensor([[1, 1, 1], [1, 0, 0]], dtype=torch.bool)
    adv, ret = run("reinforce_plus_plus", r, m, torch.tensor([0, 0]), gamma=0.5)
    close(ret, [[1, 2, 4], [2, 0, 0]], atol=0)
    sd = math.sqrt(4.75 / 3 + WHITEN_EPS)      # mean 2.25, sum of squared deviations 4.75
    close(adv, [[-1.25 / sd, -0.25 / sd, 1.75 / sd], [-0.25 / sd, 0, 0]], atol=1e-12)


def test_reinforce_plus_plus_baseline_hand_worked():
    # group {0, 1}: scores 4, 2 -> +1, -1; singleton row 2: score 3 -> 3 (baseline 0)
    r = torch.tensor([[0, 0, 4.], [2, 0, 0], [0, 3, 0]], dtype=F64)
    m = torch.tensor([[1, 1, 1], [1, 0, 0], [1, 1, 0]], dtype=torch.bool)
    adv, _ = run("reinforce_plus_plus_baseline", r, m, torch.tensor([5, 5, 6]))
    # token values 1,1,1,-1,3,3: mean 4/3, Bessel var (3/9 + 49/9 + 50/9) / 5
    sd = math.sqrt(102 / 9 / 5 + WHITEN_EPS)
    a, b, c = -1 / 3 / sd, -7 / 3 / sd, 5 / 3 / sd
    close(adv, [[a, a, a], [b, 0, 0], [c, c, 0]], atol=1e-12)


# ---- properties (hypothesis) --------------------------------------------------------------------
UID_POOL = [0, 1, -7, 2**62, -(2**62), 123456789]


@st.composite
def batches(draw):
    b = draw(st.integers(1, 7))
    r_w = draw(st.integers(1, 5))
    quarter = st.integers(-12, 12).map(lambda k: k / 4)     # exact binary fractions
    r = torch.tensor(draw(st.lists(st.lists(quarter, min_size=r_w, max_size=r_w),
                                   min_size=b, max_size=b)), dtype=F64)
    v = torch.tensor(draw(st.lists(st.lists(quarter, min_size=r_w, max_size=r_w),
                                   min_size=b, max_size=b)), dtype=F64)
    m = torch.tensor(draw(st.lists(st.lists(st.booleans(), min_size=r_w, max_size=r_w),
                                   min_size=b, max_size=b)))
    uid = torch.tensor(draw(st.lists(st.sampled_from(UID_POOL), min_size=b, max_size=b)))
    gamma = draw(st.sampled_from([1.0, 0.9, 0.5]))
    lam = draw(st.sampled_from([1.0, 0.95, 0.5]))
    return r, m, uid, v, gamma, lam


@pytest.mark.parametrize("name", NAMES)
@given(batch=batches(), norm=st.booleans())
def test_matches_naive_loops(name, batch, norm):
    r, m, uid, v, gamma, lam = batch
    adv, ret = run(name, r, m, uid, v, gamma=gamma, lam=lam, norm_adv_by_std_in_grpo=norm)
    n_adv, n_ret = naive(name, r, m, uid, v, gamma=gamma, lam=lam, norm=norm)
    close(adv, n_adv, atol=1e-7)
    close(ret, n_ret, atol=1e-9)
    assert adv.dtype == F64 and adv.shape == r.shape
    assert not adv[~m].any() and not ret[~m].any()


@pytest.mark.parametrize("name", NAMES)
@given(batch=batches(), seed=st.integers(0, 2**16))
def test_row_order_and_masked_values_do_not_matter(name, batch, seed):
    r, m, uid, v, gamma, lam = batch
    adv, ret = run(name, r, m, uid, v, gamma=gamma, lam=lam)
    perm = torch.randperm(r.shape[0], generator=torch.Generator().manual_seed(seed))
    p_adv, p_ret = run(name, r[perm], m[perm], uid[perm], v[perm], gamma=gamma, lam=lam)
    assert torch.allclose(p_adv, adv[perm], atol=1e-10, rtol=0)
    assert torch.allclose(p_ret, ret[perm], atol=1e-10, rtol=0)
    # garbage (NaN, inf, huge) under mask 0 changes nothing, bit for bit
    junk = torch.tensor([float("nan"), float("inf"), -1e30], dtype=F64)
    fill = junk[torch.arange(r.numel()) % 3].view_as(r)
    g_adv, g_ret = run(name, torch.where(m, r, fill), m, uid, torch.where(m, v, fill),
                       gamma=gamma, lam=lam)
    assert torch.equal(g_adv, adv) and torch.equal(g_ret, ret)


@pytest.mark.parametrize("name", NAMES)
def test_inputs_untouched_outputs_fresh(name):
    r, m, uid = _outcome_batch()
    v = torch.rand(r.shape, dtype=F64)
    ins = [r, m.float(), uid, v]
    before = [(t.clone(), t._version) for t in ins]
    adv, ret = run(name, r, ins[1], uid, v)
    for t, (copy, ver) in zip(ins, before):
        assert torch.equal(t, copy) and t._version == ver
    ptrs = {t.untyped_storage().data_ptr() for t in ins}
    assert adv.untyped_storage().data_ptr() not in ptrs
    assert ret.untyped_storage().data_ptr() not in ptrs | {adv.untyped_storage().data_ptr()}


@pytest.mark.parametrize("name", NAMES)
def test_float32_and_float_mask(name):
    r, m, uid = _outcome_batch()
    v = torch.zeros_like(r)
    a64, _ = run(name, r, m, uid, v)
    a32, _ = run(name, r.float(), m.float(), uid, v.float())
    assert a32.dtype == torch.float32
    assert torch.allclose(a32.double(), a64, atol=1e-5)


def test_bad_inputs():
    r, m, uid = _outcome_batch()
    with pytest.raises(InputError, match="values"):
        run("gae", r, m, uid)
    with pytest.raises(InputError, match="uid"):
        run("grpo", r, m, uid.double())
    with pytest.raises(InputError, match="uid"):
        run("grpo", r, m, uid[:2])
    with pytest.raises(InputError, match="response_mask"):
        run("grpo", r, m[:, :2], uid)
    with pytest.raises(InputError, match="response_mask.*0 and 1"):
        run("grpo", r, m.float() * 2, uid)
    with pytest.raises(InputError, match="token_level_rewards"):
        run("grpo", r.long(), m, uid)


def test_all_masked_batch_is_zero_not_nan():
    r = torch.ones(3, 2, dtype=F64)
    m = torch.zeros(3, 2, dtype=torch.bool)
    for name in NAMES:
        adv, ret = run(name, r, m, torch.tensor([1, 1, 2]), torch.ones_like(r))
        assert torch.equal(adv, torch.zeros_like(r)) and torch.equal(ret, torch.zeros_like(r))
