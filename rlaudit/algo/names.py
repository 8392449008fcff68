"""Every algo registry in one place (for config validation, `rlaudit list` and the docs)."""

from rlaudit.algo.advantages import ADV_ESTIMATORS
from rlaudit.algo.agg import AGG_MODES
from rlaudit.algo.distill import DISTILL_LOSSES
from rlaudit.algo.kl import KL_ESTIMATORS
from rlaudit.algo.policy_loss import POLICY_LOSSES
from rlaudit.algo.registry import Registry

ALL = {
    "advantage estimators": ADV_ESTIMATORS,
    "loss aggregation modes": AGG_MODES,
    "KL estimators": KL_ESTIMATORS,
    "policy losses": POLICY_LOSSES,
    "distillation losses": DISTILL_LOSSES,
}


def catalogue_section() -> dict:
    """The "algo" section of rlaudit.catalogue's name cache: registry attribute -> its kind, the
    kind ``rlaudit list`` displays, and its names (aliases included)."""
    display = {id(reg): kind for kind, reg in ALL.items()}
    return {attr: {"kind": reg.kind, "display": display.get(id(reg), reg.kind),
                   "names": reg.names()}
            for attr, reg in list(globals().items()) if isinstance(reg, Registry)}
