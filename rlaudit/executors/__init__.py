"""Where ``rlaudit run`` carries out its scenario x backend jobs.

    local   this machine, two scenarios in flight; multi-rank backends (and the reference beside
            them) reuse warm rank pools (rlaudit/backends/launch/pool.py) for the whole
            invocation (the default)
    ray     Ray tasks and actors: every multi-rank job a placement group with one bundle per rank,
            the reference replays Ray tasks; a local Ray cluster, or ``--ray-address``

Both run each scenario through :func:`rlaudit.scenarios.engine.run_scenario`, handing it a
``replay(backend, request)`` that carries out one backend's replay: the variants, invariants,
goldens and reports are the same code whichever executor runs, only where the replays happen
differs. ``Executor.map(scenarios, run_one)`` yields ``(scenario, result)`` in the scenarios'
order, where ``run_one(scenario, replay)`` returns the scenario's result.

    with make_executor("local", scenarios, backends=None) as ex:
        for scn, res in ex.map(scenarios, lambda scn, replay: run_scenario(scn, replay=replay)):
            ...
"""

from rlaudit.executors.factory import EXECUTORS, make_executor
from rlaudit.executors.local import LOCAL_JOBS, LocalExecutor
from rlaudit.executors.planning import (groups_in_flight, job_count, needed_pools,
                                        pooled_backends, reference_pooled)
from rlaudit.executors.progress import Progress

__all__ = ["EXECUTORS", "LOCAL_JOBS", "LocalExecutor", "Progress", "groups_in_flight", "job_count",
           "make_executor", "needed_pools", "pooled_backends", "reference_pooled"]
