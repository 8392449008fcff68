"""The stage checks: an adapter's stage functions against rlaudit's reference, one module per
check family, registered under ``"<stage>:<property>"``.

    from rlaudit.targets.stages import run_stage_checks, stage_checks
    stage_checks()["policy_loss:parity"].doc

- ``registry.py``: the registry, :class:`StageEnv` (what a check is handed) and :class:`Tally`.
- ``advantage.py`` (advantages, KL in reward, KL estimators), ``agg.py``, ``loss.py`` (policy and
  distillation losses), ``value.py`` (the critic's value loss), ``batch.py`` (micro-batching,
  train_step), ``filter.py`` (DAPO's group filter), ``identity.py`` (identities and config
  effects), ``mutation.py`` (no-mutation).
- ``suite.py``: :func:`run_stage_checks`, the pseudo-scenario ``"stages"``.
"""

from rlaudit.targets.stages import (advantage, agg, batch, filter,  # noqa: F401  (register
                                    identity, loss, mutation, value)  # their checks)
from rlaudit.targets.stages.registry import StageCheck, StageEnv, Tally, stage_check
from rlaudit.targets.stages.suite import run_stage_checks, stage_checks

__all__ = ["StageCheck", "StageEnv", "Tally", "run_stage_checks", "stage_check", "stage_checks"]
