"""The train_step audit of a target (``rlaudit run --target``).

- ``runner.py``: :func:`run_target`, stage checks then run-level invariants per scenario.
- ``target_backend.py``: :class:`TargetBackend`, an adapter's train_step as a backend.
- ``parity.py``: run-level invariants with the target as a backend, parity against the reference.
- ``noise.py``: the noise floor of a lower-precision target.
- ``localise.py``: where a failing target first leaves the reference.
- ``found.py``: stage cases written by ``rlaudit fuzz``, replayed.
- ``validate.py``: a target's inputs checked before anything runs.
"""

from rlaudit.targets.run.runner import run_target, run_target_scenario
from rlaudit.targets.run.target_backend import TargetBackend
from rlaudit.targets.run.validate import validate_target

__all__ = ["TargetBackend", "run_target", "run_target_scenario", "validate_target"]
