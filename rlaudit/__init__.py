"""rlaudit: a correctness-regression and metric-audit harness for LLM RL post-training.

Layers (imports flow one way, left to right):
    algo, data  <-  model  <-  update  <-  trainer, rollout, backends  <-  targets, scenarios
    <-  report, cli, pytest_plugin
"""

__version__ = "0.1.0"
