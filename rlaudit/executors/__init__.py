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

from __future__ import annotations

import importlib

#: name -> module of this package; resolved on first use, so that a light submodule (the Ray
#: address check that `rlaudit run`'s option checks use) does not import torch through the face
_EXPORTS = {
    "EXECUTORS": "factory", "make_executor": "factory",
    "LOCAL_JOBS": "local", "LocalExecutor": "local",
    "groups_in_flight": "planning", "job_count": "planning", "needed_pools": "planning",
    "pooled_backends": "planning", "reference_pooled": "planning",
    "Progress": "progress",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
