"""rlaudit: a correctness-regression and metric-audit harness for LLM RL post-training.

Modules live on floors and import one way, from lower floors only (docs/internals.md, "Layers";
enforced by tests/test_house.py).
"""

__version__ = "0.1.0"
