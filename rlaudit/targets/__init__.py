"""Auditing someone else's trainer: the adapter API and the checks run through it.

    rlaudit run --target mypkg.audit:MyAdapter           # stage checks + built-in scenario
    rlaudit run --target mypkg.audit:MyAdapter seed_entropy_coeff_zero

- ``adapter.py``: the contract (stage signatures, :class:`TrainStepOutput`, loading ``mod:Attr``).
- ``checks.py``, ``loss_checks.py``, ``batch_checks.py``: stage-level checks (with ``cases.py``,
  the deterministic inputs, and ``guard.py``, the no-mutation/no-aliasing watch).
- ``backend_adapter.py``: an adapter's train_step as a backend for the run-level invariants.
- ``runner.py``: :func:`run_target`; ``builtin.py``: the scenario used when none is named.
- ``reference.py``: rlaudit's own reference and built-in backends as adapters.

docs/targets.md is the user guide.
"""

from rlaudit.targets.adapter import STAGES, TargetAdapter, TrainStepOutput, load_adapter
from rlaudit.targets.declare import Difference

__all__ = ["STAGES", "Difference", "TargetAdapter", "TrainStepOutput", "load_adapter",
           "run_target"]


def __getattr__(name: str):
    if name == "run_target":  # lazy: the runner imports the scenario engine and backends
        from rlaudit.targets.runner import run_target
        return run_target
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
