"""kl_penalty's stage case past the KL clamps (rlaudit.targets.inputs.cases.kl_clamp_case).

Hand-worked k3 = e^d - d - 1 of d = ref - logp: at d = -3, e^-3 + 2 = 2.0498 and at d = -2,
e^-2 + 1 = 1.1353 (inside the clamp); at d = 3, 16.086 and at d = 4, 49.598 (both clamped to
10). The ordinary cases keep |d| <= 0.5 (k3 <= 0.15), where no clamp acts.
"""

from __future__ import annotations

import math

import torch

import broken_adapters as broken
from rlaudit.targets.contract.own_adapters import ReferenceAdapter
from rlaudit.targets.inputs.cases import kl_clamp_case
from rlaudit.targets.stages import run_stage_checks
from rlaudit.verdict.result import FAIL, PASS


def test_the_case_holds_the_log_ratios_past_the_clamps():
    case = kl_clamp_case()
    d = (case["ref_log_probs"] - case["log_probs"])[case.mask].tolist()
    assert d == [-3.0, -2.0, 3.0, 4.0, 4.0, -0.5, 0.5]
    assert bool((case["log_probs"][case.mask] <= -0.5).all())
    assert bool((case["ref_log_probs"][case.mask] <= -0.5).all())
    assert not bool(case.mask[1, 3])


def test_the_reference_k3_is_clamped_at_ten_there():
    case = kl_clamp_case()
    got = ReferenceAdapter().kl_penalty(log_prob=case["log_probs"],
                                        ref_log_prob=case["ref_log_probs"], kind="k3")[0]
    want = [math.exp(-3) + 2, math.exp(-2) + 1, 10.0, 10.0]      # 16.09 and 49.6 clamped
    assert torch.allclose(got, torch.tensor(want, dtype=torch.float64), rtol=1e-12, atol=0)


def test_k3_without_its_clamps_is_red_on_kl_penalty_parity_on_that_case_only():
    checks = {c.invariant: c for c in
              run_stage_checks(broken.K3WithoutClamps(), stages=["kl_penalty"]).checks}
    parity = checks["kl_penalty:parity"]
    assert parity.status == FAIL, parity.message
    problems = [f["message"] if isinstance(f, dict) else str(f)
                for f in parity.details.get("failures", [])] or [parity.message]
    assert all("kl-clamp" in p for p in problems), problems
    assert run_stage_checks(ReferenceAdapter(), stages=["kl_penalty"]).checks[0].status == PASS
