"""compare_tensors against an element-by-element reading of its contract: entry i is out of
tolerance when it is inside the mask and either got[i] is not finite while want[i] is, or
|got[i] - want[i]| > atol + rtol * |want[i]| + slack[i]. Values include NaN, +-inf, -0.0,
subnormals and exact boundary cases (got = want + bound)."""

from __future__ import annotations

import math
import re

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlaudit.verdict.tensors import compare_tensors
from rlaudit.verdict.tolerance import Tolerance

SPECIAL = [0.0, -0.0, 1.0, -1.0, 1e-300, 5e-324, 1e300, math.inf, -math.inf, math.nan, 0.5]


def _oracle(got, want, mask, atol, rtol, slack):
    """({index: how far out of tolerance} of the entries out of it -- inf for a non-finite one
    --, largest |got - want| inside the mask: NaN if any is NaN)."""
    out, errs = {}, []
    for i, (g, w) in enumerate(zip(got, want)):
        if mask is not None and not mask[i]:
            continue
        s = slack[i] if isinstance(slack, list) else slack
        err = abs(g - w)
        errs.append(err)
        bound = atol + rtol * abs(w) + s
        if not math.isfinite(g) and math.isfinite(w):
            out[i] = math.inf
        elif err > bound:
            out[i] = err - bound
    worst = math.nan if any(math.isnan(e) for e in errs) else max(errs, default=0.0)
    return out, worst


values = st.one_of(st.sampled_from(SPECIAL), st.floats(-10, 10), st.floats(allow_nan=True))


@settings(max_examples=300, deadline=None)
@given(data=st.data(), n=st.integers(0, 9), atol=st.sampled_from([0.0, 1e-12, 1e-6, 0.5]),
       rtol=st.sampled_from([0.0, 1e-9, 1e-3]), masked=st.booleans(),
       slack_kind=st.sampled_from(["zero", "scalar", "tensor"]))
def test_compare_tensors_matches_the_contract_entry_by_entry(data, n, atol, rtol, masked,
                                                             slack_kind):
    want = data.draw(st.lists(values, min_size=n, max_size=n))
    got = []
    for w in want:   # near misses and exact boundaries as well as arbitrary values
        how = data.draw(st.sampled_from(["any", "same", "edge", "nudge"]))
        if how == "same":
            got.append(w)
        elif how == "edge" and math.isfinite(w):
            got.append(w + (atol + rtol * abs(w)))
        elif how == "nudge" and math.isfinite(w):
            got.append(math.nextafter(w + (atol + rtol * abs(w)), math.inf))
        else:
            got.append(data.draw(values))
    mask = data.draw(st.lists(st.booleans(), min_size=n, max_size=n)) if masked else None
    slack = {"zero": 0.0, "scalar": 1e-3,
             "tensor": data.draw(st.lists(st.floats(0, 1), min_size=n, max_size=n))}[slack_kind]
    g = torch.tensor(got, dtype=torch.float64)
    w = torch.tensor(want, dtype=torch.float64)
    m = torch.tensor(mask) if mask is not None else None
    s = torch.tensor(slack, dtype=torch.float64) if isinstance(slack, list) else slack
    ok, message, details = compare_tensors("x", g, w, Tolerance(rtol=rtol, atol=atol), m, slack=s)
    out, want_worst = _oracle(got, want, mask, atol, rtol, slack)
    assert ok == (not out), (message, out)
    if not ok:
        assert int(re.search(r"(\d+) entries out of tolerance", message).group(1)) == len(out)
        named = [w["index"][0] for w in details["worst"]]
        # the worst entries, worst first, each one out of tolerance (never one whose
        # expectation is NaN, which is not compared)
        assert len(named) == min(3, len(out)) and set(named) <= set(out), (named, out)
        assert [out[i] for i in named] == sorted(out.values(), reverse=True)[:len(named)]
    got_worst = details["max_abs_diff"]
    assert (math.isnan(got_worst) and math.isnan(want_worst)) or got_worst == want_worst


def test_compare_tensors_float32_inputs_and_2d_masks():
    want = torch.tensor([[1.0, 2.0], [3.0, 4.0]], dtype=torch.float32)
    got = want.clone()
    got[1, 1] = 4.5           # out of tolerance, but masked off
    got[0, 1] = float("nan")  # inside the mask: a failure
    mask = torch.tensor([[1, 1], [1, 0]])
    want[1, 0] = float("nan")  # not compared: never named as the worst
    before = got.clone(), want.clone()
    ok, message, details = compare_tensors("t", got, want, Tolerance(rtol=0, atol=1e-3), mask)
    assert not ok and "1 entries out of tolerance" in message
    assert details["worst"][0]["index"] == [0, 1]
    for now, then in zip((got, want), before):   # inputs untouched
        assert now.dtype == torch.float32 and torch.equal(now.nan_to_num(7.0),
                                                          then.nan_to_num(7.0))
    close = torch.tensor([[1.0, 2.0], [3.0, 4.0]], dtype=torch.float32)
    ok, _, details = compare_tensors("t", close + 1e-4, close, Tolerance(rtol=0, atol=1e-3))
    assert ok and 0 < details["max_abs_diff"] < 1.1e-4
