"""Every algo registry in one place (for config validation, `rlaudit list` and the docs)."""

from rlaudit.algo.advantages import ADV_ESTIMATORS
from rlaudit.algo.agg import AGG_MODES
from rlaudit.algo.distill import DISTILL_LOSSES
from rlaudit.algo.kl import KL_ESTIMATORS
from rlaudit.algo.policy_loss import POLICY_LOSSES

ALL = {
    "advantage estimators": ADV_ESTIMATORS,
    "loss aggregation modes": AGG_MODES,
    "KL estimators": KL_ESTIMATORS,
    "policy losses": POLICY_LOSSES,
    "distillation losses": DISTILL_LOSSES,
}
