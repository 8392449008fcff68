"""The invariant registry: named checks, each of a family (docs/scenarios.md, docs/internals.md).

    from rlaudit.scenarios.invariants import INVARIANTS
    INVARIANTS.get("stored-kl-unaltered").doc
"""

from rlaudit.scenarios.invariants import (health, identities, metamorphic, parity,  # noqa: F401
                                           reward, reward_logging, rollout_corr, seeds)
from rlaudit.scenarios.invariants.base import (INVARIANTS, CheckContext, Invariant,
                                               catalogue_section)

__all__ = ["INVARIANTS", "CheckContext", "Invariant", "catalogue_section"]
