"""The pinned verl 0.9.1 the step tests run (test_verl_train_step.py, test_verl_train_kl.py,
test_verl_dp.py): where it lies, the tiny model they train, and why they skip without it."""

from __future__ import annotations

import importlib.util

from peer_cli import REPO

from rlaudit.targets.peers import peers_dir

MODEL = REPO / "scenarios" / "models" / "qwen2-tiny-short"
PEER = peers_dir() / "verl-0.9.1"


def missing() -> str:
    """Why verl 0.9.1's step cannot run here ("" when it can)."""
    if not (PEER / "verl").is_dir():
        return f"verl 0.9.1 is not installed under {PEER.parent} (run `make peers`)"
    if not (PEER / "hydra").is_dir() and importlib.util.find_spec("hydra") is None:
        return (f"hydra-core is missing from {PEER} (verl/utils/config.py:48 needs it; "
                f"re-run `make peers`)")
    return ""
