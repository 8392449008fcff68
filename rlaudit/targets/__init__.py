"""Auditing someone else's trainer: the adapter API and the checks run through it.

    rlaudit run --target mypkg.audit:MyAdapter           # stage checks + built-in scenario
    rlaudit run --target mypkg.audit:MyAdapter seed_entropy_coeff_zero

A wing of rooms, each importing only the ones before it:

- ``contract/``: what a user writes against (the adapter API, the stage signatures, declarations,
  the mutation/aliasing guard, rlaudit's own adapters).
- ``inputs/``: the fixed stage inputs, the built-in model and scenario, DAPO's unfiltered rows.
- ``stages/``: the stage checks, one module per family, and their runner.
- ``run/``: the train_step audit (:func:`run_target`), the target as a backend, parity, the noise
  floor, localisation, stage cases found by the fuzzer, and validating a target before a run.
- ``fuzz/``: ``rlaudit fuzz``.
- ``peers/``: first-party adapters over verl, SkyRL, slime and TRL (import only ``contract/``).

docs/targets.md is the user guide.
"""

from rlaudit.targets.contract import (STAGES, Difference, Stages, TargetAdapter, TrainStepOutput,
                                      UnsupportedFeature, load_adapter)

__all__ = ["STAGES", "Difference", "Stages", "TargetAdapter", "TrainStepOutput",
           "UnsupportedFeature", "load_adapter", "run_target"]


def __getattr__(name: str):
    if name == "run_target":  # lazy: the runner imports the scenario engine and backends
        from rlaudit.targets.run.runner import run_target
        return run_target
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
