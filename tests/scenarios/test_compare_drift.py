"""compare_runs' ``drift`` (the "worst drift" column of the console table and the report): on a
failure it is at least the worst failing entry's relative deviation, whether the failure is in a
metric, a per-token tensor or the parameters -- a FAIL row showing a passing variant's 1e-12
drift while the parameters are off by 3 misleads whoever reads the table. Passing comparisons
keep measuring metrics only."""

from __future__ import annotations

import copy

import pytest
import torch

from rlaudit.backends.base import VariantRun
from rlaudit.verdict.compare import compare_runs
from rlaudit.verdict.tolerance import Tolerance


class _Scn:
    def tol(self, name):
        return Tolerance(rtol=1e-9, atol=1e-11)


def _run():
    run = VariantRun(name="v")
    run.steps = [{"actor/pg_loss": 0.5, "actor/entropy": 2.0}]
    run.tokens = {"old_log_probs": torch.tensor([[-1.0, -2.0], [-0.5, -4.0]], dtype=torch.float64)}
    run.param_names = ["w"]
    run.params = [torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)]
    return run


MASK = torch.ones(2, 2, dtype=torch.bool)


def test_a_parameter_failure_sets_the_drift():
    want, got = _run(), _run()
    got.steps[0]["actor/pg_loss"] = 0.5 * (1 + 1e-12)      # metrics agree
    got.params[0][2] = 12.0                                  # 3 -> 12: 300 % off
    c = compare_runs(_Scn(), got, want, mask=MASK)
    assert not c.ok and "parameters after step 0" in c.message
    assert c.drift == pytest.approx(3.0)


def test_a_token_failure_sets_the_drift():
    want, got = _run(), _run()
    got.tokens["old_log_probs"][1, 1] = -5.0                 # -4 -> -5: 25 % off
    c = compare_runs(_Scn(), got, want, mask=MASK)
    assert not c.ok and "old_log_probs" in c.message
    assert c.drift == pytest.approx(0.25)


def test_a_passing_comparison_measures_metrics_only():
    want = _run()
    got = copy.deepcopy(want)
    got.steps[0]["actor/entropy"] = 2.0 * (1 + 1e-10)
    got.params[0][2] = 3.0 * (1 + 5e-10)                     # within rtol 1e-9: not counted
    got.tokens["old_log_probs"][0, 0] = -1.0 * (1 + 5e-10)   # within rtol 1e-9: not counted
    c = compare_runs(_Scn(), got, want, mask=MASK)
    assert c.ok
    assert c.drift == pytest.approx(1e-10, rel=1e-3)


def test_an_infinite_entry_fails_but_keeps_the_drift_finite():
    want, got = _run(), _run()
    got.tokens["old_log_probs"][0, 0] = float("inf")
    got.tokens["old_log_probs"][1, 1] = -5.0                 # 25 % off: what the drift shows
    c = compare_runs(_Scn(), got, want, mask=MASK)
    assert not c.ok and "old_log_probs" in c.message
    assert c.drift == pytest.approx(0.25)
