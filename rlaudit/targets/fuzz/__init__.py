"""``rlaudit fuzz --target X``: the stage checks driven by Hypothesis (``stage_fuzz.py``, with the
strategies of ``strategies.py``), train_step fuzzed at run level (``train_step.py``), and what a
run reports (``findings.py``)."""

from rlaudit.targets.fuzz.findings import CheckOutcome, Finding, FuzzReport
from rlaudit.targets.fuzz.stage_fuzz import DEFAULT_BUDGET, fuzz_target
from rlaudit.targets.fuzz.train_step import DEFAULT_RUN_BUDGET, fuzz_train_step

__all__ = ["DEFAULT_BUDGET", "DEFAULT_RUN_BUDGET", "CheckOutcome", "Finding", "FuzzReport",
           "fuzz_target", "fuzz_train_step"]
