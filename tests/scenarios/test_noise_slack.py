"""How the run-level noise floor turns into slack on a metric (compare_runs): continuous metrics
share one relative spread per step; counted fractions (clip fractions: ``MetricSpec.counted``)
share one absolute spread of their own, so a token tipped over a clip bound by rounding widens
the clip fractions -- which it does move by a whole count -- and nothing else.

The numbers are worked by hand: 196 tokens, one token = 1/196 = 0.0051; NOISE_FACTOR = 10.
"""

from __future__ import annotations

import copy

import pytest

import torch

from rlaudit.backends.base import VariantRun
from rlaudit.metrics import CATALOGUE
from rlaudit.verdict.compare import compare_runs
from rlaudit.verdict.tolerance import Tolerance

TOKEN = 1 / 196
MASK = torch.ones(1, 1, dtype=torch.bool)


class _Scn:
    def tol(self, name):
        return Tolerance(rtol=1e-4, atol=1e-5)      # a float32 target's run-level floor


def _run(**metrics):
    run = VariantRun(name="base")
    run.steps = [{"actor/pg_loss": 0.40, "actor/entropy": 1.5, "actor/pg_clipfrac": 56 * TOKEN,
                  "actor/pg_clipfrac_lower": 1 * TOKEN, **metrics}]
    return run


def _compare(got, want):
    return compare_runs(_Scn(), got, want, mask=MASK, tokens=(), params=False)


def _with_noise(want, **noisy):
    want.noise = copy.deepcopy(want)
    want.noise.steps[0].update(noisy)
    return want


def test_a_flip_the_perturbed_reference_made_covers_one_in_another_clip_fraction():
    # the perturbed reference tipped the one dual-clipped token back: pg_clipfrac_lower 1 -> 0
    want = _with_noise(_run(), **{"actor/pg_clipfrac_lower": 0.0})
    got = _run(**{"actor/pg_clipfrac": 55 * TOKEN})           # the target tips a clipped one
    assert _compare(got, want).ok
    # without the perturbed replay the same one-token move is a failure (0.0051 > 1e-5 + 2.9e-6)
    assert not _compare(got, _run()).ok


def test_a_flip_does_not_widen_the_continuous_metrics():
    # before counted fractions pooled apart, 1/196 on a fraction of 1/196 was a relative spread
    # of 1 for every metric: pg_loss was allowed to be off by ten times its own value
    want = _with_noise(_run(), **{"actor/pg_clipfrac_lower": 0.0})
    got = _run(**{"actor/pg_loss": 0.40 * 1.01})              # 1 % off
    c = _compare(got, want)
    assert not c.ok and "actor/pg_loss" in c.message


def test_continuous_metrics_still_share_one_relative_spread():
    # entropy moved 1e-4 relative in the perturbed replay: every continuous metric gets 10x that
    want = _with_noise(_run(), **{"actor/entropy": 1.5 * (1 + 1e-4)})
    assert _compare(_run(**{"actor/pg_loss": 0.40 * (1 + 8e-4)}), want).ok    # 8e-4 < 1e-3 + tol
    assert not _compare(_run(**{"actor/pg_loss": 0.40 * (1 + 3e-3)}), want).ok
    # and a counted fraction gets at least the continuous slack (10 * 1e-4 * 0.2857 = 2.9e-4)
    assert _compare(_run(**{"actor/pg_clipfrac": 56 * TOKEN + 2e-4}), want).ok


def test_every_fraction_in_the_catalogue_is_counted_and_nothing_else():
    """Read off the catalogue's own wording, not the flags: a metric documented as a "fraction
    of" tokens or responses moves by whole counts; any other metric varies continuously."""
    for name, s in CATALOGUE.items():
        assert bool(s.counted) == s.doc.startswith("fraction of"), name


def test_widest_keeps_the_larger_distance_of_two_draws():
    from rlaudit.verdict.compare import widest
    want, a, b = _run(), _run(), _run()
    a.steps[0]["actor/pg_loss"], b.steps[0]["actor/pg_loss"] = 0.41, 0.37    # 0.01 vs 0.03
    a.steps[0]["actor/entropy"], b.steps[0]["actor/entropy"] = 1.6, 1.45    # 0.1 vs 0.05
    for r, v in ((want, [1.0, 2.0]), (a, [1.5, 2.0]), (b, [0.0, 2.25])):
        r.tokens = {"old_log_probs": torch.tensor([v], dtype=torch.float64)}
        r.params = [torch.tensor(v, dtype=torch.float64)]
    w = widest(want, a, b)
    assert w.steps[0]["actor/pg_loss"] == pytest.approx(0.43)    # 0.40 + 0.03
    assert w.steps[0]["actor/entropy"] == pytest.approx(1.6)     # 1.5 + 0.1
    assert w.tokens["old_log_probs"].tolist() == [[2.0, 2.25]]   # 1 + max(0.5, 1), 2 + 0.25
    assert w.params[0].tolist() == [2.0, 2.25]


def test_near_misses_records_how_far_a_floored_comparison_failed():
    from rlaudit.verdict.compare import near_misses
    want = _with_noise(_run(), **{"actor/entropy": 1.5 * (1 + 1e-4)})
    # bound for pg_loss: 1e-5 + 1e-4 * 0.4 + 10 * 1e-4 * 0.4 = 4.5e-4; off by 9e-4: ratio 2
    with near_misses() as missed:
        assert not _compare(_run(**{"actor/pg_loss": 0.40 + 9e-4}), want).ok
    assert missed["worst"] == pytest.approx(2.0, rel=1e-6)
    with near_misses() as missed:           # without a floor there is nothing to measure again
        assert not _compare(_run(**{"actor/pg_loss": 0.40 + 9e-4}), _run()).ok
    assert missed["worst"] == 0.0


def test_tokens_whose_advantage_rounding_can_zero_widen_the_clip_fractions():
    """Worked by hand: advantages [2.2e-7, 0, 1.2, -1.2], perturbed [1e-6, 0, 1.2 + 1e-7, -1.2]:
    the largest move is 7.8e-7, so 2.2e-7 (within 10x that of 0) is undecided; 0 in both runs
    is decided (0 at any precision), so is +-1.2. One token of four: clip fractions get 0.25."""
    mask = torch.ones(1, 4, dtype=torch.bool)
    want = _run()
    want.tokens = {"advantages": torch.tensor([[2.2e-7, 0.0, 1.2, -1.2]], dtype=torch.float64)}
    want.noise = copy.deepcopy(want)
    want.noise.tokens["advantages"] = torch.tensor([[1e-6, 0.0, 1.2 + 1e-7, -1.2]],
                                                   dtype=torch.float64)

    def compare(**metrics):
        got = _run(**metrics)
        got.tokens = {"advantages": want.tokens["advantages"].clone()}
        return compare_runs(_Scn(), got, want, mask=mask, params=False)

    assert compare(**{"actor/pg_clipfrac": 56 * TOKEN - 0.24}).ok
    assert not compare(**{"actor/pg_clipfrac": 56 * TOKEN - 0.26}).ok
    # a fraction the advantage's sign does not decide (the value clip) gets no such room
    want.steps[0]["critic/vf_clipfrac"] = want.noise.steps[0]["critic/vf_clipfrac"] = 0.5
    assert not compare(**{"critic/vf_clipfrac": 0.5 - 0.05}).ok
    assert not compare(**{"actor/pg_loss": 0.40 * 1.01}).ok       # continuous: not widened
    # with the 2.2e-7 advantage exactly 0 in both runs nothing is undecided
    want.tokens["advantages"][0, 0] = 0.0
    want.noise.tokens["advantages"][0, 0] = 0.0
    assert not compare(**{"actor/pg_clipfrac": 56 * TOKEN - 0.01}).ok


def test_a_zero_bound_is_no_near_miss_and_no_crash():
    """A scenario tolerance of 0 with a perturbed replay that moved nothing: the bound is 0, the
    ratio infinite (a failure no further draw can decide), not a ZeroDivisionError."""
    from rlaudit.verdict.compare import near_misses

    class Exact:
        def tol(self, name):
            return Tolerance(rtol=0.0, atol=0.0)

    want = _with_noise(_run())
    with near_misses() as missed:
        c = compare_runs(Exact(), _run(**{"actor/pg_loss": 0.41}), want, mask=MASK, tokens=(),
                         params=False)
    assert not c.ok and missed["worst"] == float("inf")


# ---- how many draws of the floor the target runner measures ------------------------------------

def _draws(spreads, off):
    """The target runner's loop (run/noise.py, with_noise_floor) on one metric comparison: ``got``'s
    pg_loss is ``off`` from the reference's; draw i of the floor moves the entropy by
    ``spreads[i]`` relative (the widest draw so far is what the comparison sees). Worked by hand:
    a relative spread s gives pg_loss the bound 1e-5 + 1e-4 * 0.4 + 10 * s * 0.4."""
    from rlaudit.verdict.result import FAIL, PASS, CheckResult
    from rlaudit.targets.run.noise import with_noise_floor

    want, got = _run(), _run(**{"actor/pg_loss": 0.40 + off})
    drawn = []

    def measure(draw):
        drawn.append(draw)
        _with_noise(want, **{"actor/entropy": 1.5 * (1 + max(spreads[:draw + 1]))})

    def checks():
        ok = _compare(got, want).ok
        return [CheckResult("backend-parity", "t", PASS if ok else FAIL, "")]

    found = with_noise_floor(checks(), checks, measure)
    return found[0].status, drawn


def test_the_floor_is_measured_only_when_a_check_fails_and_again_only_on_a_near_miss():
    from rlaudit.verdict.result import FAIL, PASS
    from rlaudit.targets.run.noise import NOISE_DRAWS
    assert NOISE_DRAWS == 3
    # passes without a floor (bound 5e-5): nothing measured
    assert _draws([1e-4, 1e-4, 1e-4], 4e-5) == (PASS, [])
    # 9e-4 off: draw 0 (s = 1e-4) bounds it by 4.5e-4, a miss by 2x; draw 1 (s = 3e-4) by 1.25e-3
    assert _draws([1e-4, 3e-4, 0.0], 9e-4) == (PASS, [0, 1])
    # draw 0 already decides it: no second draw
    assert _draws([3e-4, 3e-4, 3e-4], 9e-4) == (PASS, [0])
    # a miss by 10x (s = 1e-5: bound 9e-5) is a finding, not a near miss: one draw
    assert _draws([1e-5, 1e-2, 1e-2], 9e-4) == (FAIL, [0])
    # near misses on every draw: NOISE_DRAWS draws, then it stands
    assert _draws([1e-4, 1e-4, 1e-4], 9e-4) == (FAIL, [0, 1, 2])
    # 4x is still near (bound 4.5e-4, off 1.8e-3), just over 4x is not
    assert _draws([1e-4, 3e-3, 0.0], 1.8e-3 * (1 - 1e-9)) == (PASS, [0, 1])
    assert _draws([1e-4, 3e-3, 0.0], 1.8e-3 * (1 + 1e-6)) == (FAIL, [0])


def test_a_failure_no_floor_bounds_is_not_measured_again():
    """A check that fails without any floored comparison (nothing near to decide) costs one
    draw: the one that showed the floor could not help."""
    from rlaudit.verdict.result import FAIL, CheckResult
    from rlaudit.targets.run.noise import with_noise_floor
    drawn = []
    out = with_noise_floor([CheckResult("x", "t", FAIL, "raised")],
                           lambda: [CheckResult("x", "t", FAIL, "raised")], drawn.append)
    assert [r.status for r in out] == [FAIL] and drawn == [0]


def test_moved_onto_lays_the_reference_spread_on_another_run():
    """The reference moved by the perturbation (0.40 -> 0.43, token 2.0 -> 1.5, a parameter 1.0
    -> 1.25) gives another backend's run (0.50, token 3.0, parameter 5.0) the same distances:
    0.53, 3.5, 5.25; a metric the reference lacks gets none; comparing that backend's run with
    itself moved by 0.02 passes (bound 1e-5 + 5e-5 + 10 * 0.06 * 0.5), by 0.5 does not."""
    from rlaudit.verdict.compare import moved_onto
    ref, noisy, onto = _run(), _run(**{"actor/pg_loss": 0.43}), _run(**{"actor/pg_loss": 0.50})
    onto.steps[0]["actor/only_here"] = 1.0
    ref.tokens = {"old_log_probs": torch.tensor([[2.0]], dtype=torch.float64)}
    noisy.tokens = {"old_log_probs": torch.tensor([[1.5]], dtype=torch.float64)}
    onto.tokens = {"old_log_probs": torch.tensor([[3.0]], dtype=torch.float64)}
    ref.params, noisy.params = [torch.tensor([1.0])], [torch.tensor([1.25])]
    onto.params = [torch.tensor([5.0])]
    moved = moved_onto(noisy, ref, onto)
    assert moved.steps[0]["actor/pg_loss"] == pytest.approx(0.53)
    assert moved.steps[0]["actor/entropy"] == 1.5 and "actor/only_here" not in moved.steps[0]
    assert moved.tokens["old_log_probs"].tolist() == [[3.5]]
    assert moved.params[0].tolist() == [5.25]
    onto.noise = moved
    assert _compare(_run(**{"actor/pg_loss": 0.52}), onto).ok
    assert not _compare(_run(**{"actor/pg_loss": 1.0}), onto).ok
