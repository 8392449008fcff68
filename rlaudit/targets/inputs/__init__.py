"""The inputs a target is audited on: the fixed stage cases (``cases.py``), the built-in tiny model
and scenario (``builtin.py``), and the unfiltered rows handed to a trainer that applies DAPO's
group filter itself (``dynamic_sampling.py``)."""

from rlaudit.targets.inputs.cases import Case, Draw, default_cases

__all__ = ["Case", "Draw", "default_cases"]
