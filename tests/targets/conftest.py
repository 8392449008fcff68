"""Fixtures for the target-adapter tests: the repository root on sys.path (examples/ is not an
installed package), the tiny model snapshots and the built-in rollout (sampled once)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


@pytest.fixture(scope="session")
def tiny_model() -> str:
    from rlaudit.targets.inputs.builtin import tiny_model_path
    return str(tiny_model_path(REPO / "scenarios"))


@pytest.fixture(scope="session")
def builtin_rollout(tiny_model):
    from rlaudit.targets.inputs.builtin import rollout
    return rollout(tiny_model)
