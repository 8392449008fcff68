"""Clip fractions at tight bounds: a ratio within rounding of a clip bound may be clipped either
way by a correct trainer in another precision, so a lower-precision target's clip fractions may
differ from the reference's by as many tokens as the reference saw that close to a bound
(``actor/pg_clipfrac_undecided``), and by no more.

Hand-worked: eight tokens, advantage +1, old log-prob 0, ratios
[1.2 - 1e-7, 1.15, 1.17, 1.25, 1.3, 0.9, 1.0, 1.05] under clip_ratio 0.2 (bounds 0.8 and 1.2,
dual clip c = 3). Clipped (ratio > 1.2 with A > 0): 1.25 and 1.3, 2/8. Near a bound (within
1e-4 relative of 0.8, 1.2 or 3): only 1.2 - 1e-7, 1/8 (0.9 and 1.17 are 1e-1 and 2.5e-2 away).
A float32 trainer whose ratio for the first token comes out at 1.2 + 1e-7 clips it: 3/8. A
trainer clipping at 1.1 (clip_ratio_high 0.1) clips 1.2 - 1e-7, 1.15, 1.17, 1.25, 1.3: 5/8.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

from rlaudit.backends.base import VariantRun
from rlaudit.algo.policy_loss import compute_policy_loss
from rlaudit.metrics import CLIP_UNDECIDED
from rlaudit.update.actor import undecided_clips
from rlaudit.verdict.compare import compare_runs
from rlaudit.verdict.tolerance import Tolerance

RATIOS = [1.2 - 1e-7, 1.15, 1.17, 1.25, 1.3, 0.9, 1.0, 1.05]
MASK = torch.ones(1, len(RATIOS), dtype=torch.bool)
BOUNDS = (0.8, 1.2, 3.0)


class _Scn:
    def tol(self, name):
        return Tolerance(rtol=1e-4, atol=1e-5)      # a float32 target's run-level floor


def clipfrac(ratios: list[float], high: float = 0.2) -> float:
    """pg_clipfrac of the reference's vanilla loss on ``ratios`` (A = +1, old log-prob 0)."""
    logp = torch.tensor([[math.log(r) for r in ratios]], dtype=torch.float64)
    pol = compute_policy_loss("vanilla", old_log_prob=torch.zeros_like(logp), log_prob=logp,
                              advantages=torch.ones_like(logp), mask=MASK, clip_ratio_low=0.2,
                              clip_ratio_high=high, clip_ratio_c=3.0)
    return float(pol.clipped.double().mean())


def run(pg_clipfrac: float, undecided: float | None = None) -> VariantRun:
    r = VariantRun(name="base")
    r.steps = [{"actor/pg_loss": 0.4, "actor/pg_clipfrac": pg_clipfrac,
                "actor/pg_clipfrac_lower": 0.0}]
    if undecided is not None:
        r.steps[0][CLIP_UNDECIDED] = undecided
    return r


def reference(noise: bool = True) -> VariantRun:
    ratio = torch.tensor([RATIOS], dtype=torch.float64)
    near = undecided_clips(ratio, torch.ones_like(ratio), MASK, band=BOUNDS[:2], bounds=BOUNDS)
    want = run(clipfrac(RATIOS), float(near.double().mean()))
    if noise:       # a lower-precision target: compared against a (here flat) noise floor
        want.noise = copy.deepcopy(want)
    return want


def ok(got: VariantRun, want: VariantRun) -> bool:
    return compare_runs(_Scn(), got, want, mask=MASK, tokens=(), params=False).ok


def test_the_hand_worked_counts():
    assert clipfrac(RATIOS) == 2 / 8
    assert reference().steps[0][CLIP_UNDECIDED] == 1 / 8
    assert clipfrac([1.2 + 1e-7] + RATIOS[1:]) == 3 / 8
    assert clipfrac(RATIOS, high=0.1) == 5 / 8


def test_undecided_ratios_within_rounding_of_any_bound_and_only_valid_tokens():
    # 0.80007 is 7e-5 from 0.8 (the band there: 8e-5); 3 + 2e-4 is within 3e-4 of 3
    ratio = torch.tensor([[1.2 - 1e-7, 1.2 + 5e-4, 0.8, 0.80007, 0.80009, 3.0 + 2e-4, 1.0]],
                         dtype=torch.float64)
    mask = torch.ones_like(ratio, dtype=torch.bool)
    adv = torch.ones_like(ratio)

    def got():
        return undecided_clips(ratio, adv, mask, band=BOUNDS[:2], bounds=BOUNDS).tolist()

    assert got() == [[True, False, True, True, False, True, False]]
    mask[0, 0] = False
    assert got()[0][0] is False


def test_undecided_signs_outside_the_clip_band():
    """Outside (0.8, 1.2) the advantage's sign picks the clipped term: a residue of -1.5e-8 (a
    GRPO group mean not representable) may be 0 or positive in float32. Inside the band no
    sign clips; an advantage exactly 0 is 0 at every precision; -0.3 is no residue."""
    ratio = torch.tensor([[0.5, 0.5, 0.5, 1.5, 1.0]], dtype=torch.float64)
    adv = torch.tensor([[-1.5e-8, 0.0, -0.3, 9e-6, 1e-8]], dtype=torch.float64)
    mask = torch.ones_like(ratio, dtype=torch.bool)
    got = undecided_clips(ratio, adv, mask, band=BOUNDS[:2], bounds=BOUNDS)
    assert got.tolist() == [[True, False, False, True, False]]


def test_a_ratio_1e_7_from_the_bound_clipped_the_other_way_is_green():
    assert ok(run(clipfrac([1.2 + 1e-7] + RATIOS[1:])), reference())


def test_without_the_near_ratio_the_same_flip_is_red():
    # the same one-token move where the reference saw no ratio near a bound: 1/8 > the bound
    want = run(2 / 8, 0.0)
    want.noise = copy.deepcopy(want)
    assert not ok(run(3 / 8), want)


def test_a_trainer_clipping_at_the_wrong_bound_is_still_red():
    assert not ok(run(clipfrac(RATIOS, high=0.1)), reference())


def test_two_flips_for_one_near_ratio_are_red():
    assert not ok(run(4 / 8), reference())


def test_an_exact_target_gets_no_such_room():
    # a float64 target is compared without a noise floor: its clip fractions are exact
    assert not ok(run(clipfrac([1.2 + 1e-7] + RATIOS[1:])), reference(noise=False))


@pytest.mark.slow
def test_the_reference_reports_the_verl_row_whose_clip_rounding_decides():
    """trl_seq_importance's micro-batches of one row, reduced as micro-batch means (verl's
    declaration): 16 rows, each trained twice (32 micro-batches); one row has a GRPO advantage
    of -1.5e-8 (its group's mean is not representable; 0 in float32) and, on its second pass, a
    sequence ratio 0.99921 below GSPO's 1 - 3e-4 (on the first, 1: inside the band), so float64
    clips it there and float32 does not: one micro-batch of 32, 1/32 undecided."""
    import dataclasses

    from rlaudit.backends.registry import get_backend
    from rlaudit.scenarios import localise
    from rlaudit.scenarios.engine import scenario_rows
    from rlaudit.scenarios.invariants.base import with_overrides
    from rlaudit.scenarios.spec import load_scenario, resolve
    from rlaudit.scenarios.variants import build_variants
    scn = load_scenario(resolve(["trl_seq_importance"], all_=False, root="scenarios")[0])
    scn = dataclasses.replace(scn, config=with_overrides(
        scn.config, **{"trainer.metric_reduction": "microbatch-mean"}))
    batch, _ = scenario_rows(scn)
    (v,) = [v for v in build_variants(scn, batch) if v.name == "microbatch:1"]
    assert len(v.batch) == 16 and v.config.actor.ppo_micro_batch_size_per_gpu == 1
    run = get_backend("reference").replay(localise.replay_request(scn, [v], "reference", 900.0))
    assert run[v.name].steps[0][CLIP_UNDECIDED] == 1 / 32
