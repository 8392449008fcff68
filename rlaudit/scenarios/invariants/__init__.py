"""The invariant registry: named checks implementing the ten families of ARCHITECTURE.md.

    from rlaudit.scenarios.invariants import INVARIANTS
    INVARIANTS.get("stored-kl-unaltered").doc
"""

from rlaudit.scenarios.invariants import (health, identities, metamorphic, parity,  # noqa: F401
                                           reward, rollout_corr, seeds)
from rlaudit.scenarios.invariants.base import INVARIANTS, CheckContext, Invariant

__all__ = ["INVARIANTS", "CheckContext", "Invariant"]
