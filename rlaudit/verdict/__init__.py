"""The verdict vocabulary every upper floor shares: check and scenario results and their
statuses (:mod:`.result`), tolerances (:mod:`.tolerance`), and comparing tensors and whole runs
within them (:mod:`.tensors`, :mod:`.compare`). Import from the modules; this face re-exports
only the light names (no torch), so ``rlaudit list`` stays fast."""

from rlaudit.verdict.result import CheckResult, GoldenResult, ScenarioResult
from rlaudit.verdict.tolerance import DEFAULT_TOLERANCES, Tolerance, Tolerances

__all__ = ["DEFAULT_TOLERANCES", "CheckResult", "GoldenResult", "ScenarioResult", "Tolerance",
           "Tolerances"]
