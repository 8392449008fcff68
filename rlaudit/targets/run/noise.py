"""The noise floor of a target with a lower precision than the reference: how much rounding
alone moves each compared quantity in a scenario, measured by replaying the reference with its
weights perturbed at the target's unit roundoff (see :func:`attach_noise_floor`).
"""

from __future__ import annotations

from rlaudit.backends.base import ReplayRequest
from rlaudit.backends.registry import get_backend
from rlaudit.scenarios.invariants.parity import ORACLE
from rlaudit.scenarios.spec import Scenario
from rlaudit.verdict.compare import NEAR_MISS, moved_onto, near_misses, widest
from rlaudit.verdict.result import NA, PASS, CheckResult

#: check statuses the noise floor cannot change: it is measured only when a check ends otherwise
CLEAN = (PASS, NA)


#: draws of the perturbed replay at most (each one more replay of every variant)
NOISE_DRAWS = 3


def with_noise_floor(found: list[CheckResult], checks, measure) -> list[CheckResult]:
    """The check results once the noise floor has decided what it can: ``found`` are the checks
    without a floor, ``checks()`` runs them again, ``measure(draw)`` attaches draw ``draw`` of the
    floor (:func:`attach_noise_floor`).

    The floor only ever widens a bound, so checks that all pass without it pass with it: it is
    measured only when one does not. It is measured again, with the next draw (up to
    NOISE_DRAWS), only when every comparison it decided failed narrowly -- by at most NEAR_MISS
    times its bound (one draw's spread can fall short where clipping amplifies rounding); a
    failure by more, or by an unbounded ratio, is a finding and costs no further draw."""
    draw = 0
    while draw < NOISE_DRAWS and any(r.status not in CLEAN for r in found):
        measure(draw)
        draw += 1
        with near_misses() as missed:
            found = checks()
        if not 0.0 < missed["worst"] <= NEAR_MISS:
            break
    return found


def attach_noise_floor(runs: dict, scn: Scenario, variants, noise: float, *,
                       draw: int = 0) -> None:
    """Replay every variant on the reference with its weights perturbed by ``noise`` (the unit
    roundoff of the target's precision) and attach each result as ``run.noise`` to the runs of
    that variant on every backend: comparisons then allow a multiple of the spread rounding
    causes in this scenario (rlaudit.verdict.compare.NOISE_FACTOR).

    The floor is slack added to a bound, never taken from one: a metric's ``atol + rtol * |want|``
    gains ``NOISE_FACTOR * spread``, a per-token tensor's elementwise bound likewise, and the
    parameters, compared elementwise without a floor, are compared per tensor in L2 with one
    (``||got - want|| <= atol * sqrt(n) + rtol * ||want|| + floor``, which every elementwise pass
    meets by the triangle inequality). A check that passes without the floor therefore passes
    with it, and :func:`run_target_scenario` replays the noise only when some check does not
    pass without it (about a third of a correct target's run-level time saved).

    ``draw`` > 0: another fixed draw of the same noise, merged with those before
    (:func:`~rlaudit.verdict.compare.widest`): one draw's spread can fall short of
    a correct target's by more than NOISE_FACTOR where clipping amplifies rounding, and
    :func:`run_target_scenario` asks for the next draw when every floored comparison missed
    by at most NEAR_MISS times its bound."""
    request = ReplayRequest(model=str(scn.model), variants=variants,
                            ref_model=str(scn.ref_model) if scn.ref_model else None,
                            layout={}, dtype=scn.dtype, device=scn.device, weight_noise=noise,
                            noise_draw=draw)
    noisy = get_backend(ORACLE).replay(request)
    oracle = runs.get(ORACLE, {})
    for backend, backend_runs in runs.items():
        for name, run in backend_runs.items():
            if name not in noisy:
                continue
            # another backend's run gets the reference's spread around its own values: a
            # comparison of two of its runs then allows rounding, not its distance from the
            # reference (compare.moved_onto)
            fresh = (moved_onto(noisy[name], oracle[name], run)
                     if backend != ORACLE and name in oracle else noisy[name])
            run.noise = (fresh if run.noise is None or draw == 0
                         else widest(run, run.noise, fresh))
