"""What ``rlaudit run``'s local executor plans before any replay: which of the scenarios'
replays go to warm rank pools (:func:`needed_pools`), how many multi-rank groups may replay at
once (:func:`groups_in_flight`, what placing ranks on cores is sized for) and how many replays
there are (:func:`job_count`, for the progress line). Pure functions of the scenarios and the
backends asked for."""

from __future__ import annotations

from rlaudit import switches
from rlaudit.backends.reference import POOL
from rlaudit.backends.registry import get_backend
from rlaudit.scenarios.engine import planned_backends


def pooled_backends(scn, backends: list[str] | None) -> list[tuple[str, int]]:
    """``(pool name, world size)`` of each of ``scn``'s backends that replays in a warm pool: the
    backends whose ``rank_pool(layout)`` names one (an unavailable backend needs none; the
    reference's one-rank pool is :func:`reference_pooled`'s)."""
    out = []
    for b in planned_backends(scn, backends)[0]:
        backend = get_backend(b)
        rank_pool = getattr(backend, "rank_pool", None)
        if rank_pool is not None and backend.available()[0]:
            out.append(rank_pool(scn.backends.get(b, {})))
    return out


def reference_pooled(scn, backends: list[str] | None) -> bool:
    """Whether the local executor replays ``scn``'s reference backend in a one-rank warm pool
    rather than in its own process: on the CPU, when the scenario also replays on a multi-rank
    backend (whose ranks are forked from a forkserver that imports the model stack anyway; see
    :class:`LocalExecutor`)."""
    return (scn.device == "cpu" and "reference" in planned_backends(scn, backends)[0]
            and bool(pooled_backends(scn, backends)))


def needed_pools(scenarios, backends: list[str] | None) -> list[tuple[str, int, str, int]]:
    """``(pool name, world size, device, threads per rank)`` of every replay the scenarios will
    run in a warm pool -- the multi-rank ones and the reference where :func:`reference_pooled`
    -- in the order of first use."""
    out = []
    for scn in scenarios:
        if reference_pooled(scn, backends):
            out.append((POOL, 1, scn.device, switches.threads()))
        out += [(*pool, scn.device, 1) for pool in pooled_backends(scn, backends)]
    return list(dict.fromkeys(out))


def groups_in_flight(scenarios, backends: list[str] | None, jobs: int) -> int:
    """How many multi-rank groups may replay at once: the ``jobs`` scenarios with the most
    pooled backends, each running all of them concurrently (what the placement of the pools'
    ranks on cores is sized for: rlaudit/backends/launch/placement.py; a pooled reference
    replay is one rank, never placed, and not counted)."""
    counts = sorted((len(pooled_backends(scn, backends)) for scn in scenarios), reverse=True)
    return max(1, sum(counts[:max(1, jobs)]))


def job_count(scenarios, backends: list[str] | None) -> int:
    """How many scenario x backend replays ``run_scenario`` will do (for the progress line)."""
    return sum(len(planned_backends(scn, backends)[0]) for scn in scenarios)
