"""A verl release whose engine cannot run on the CPU at all says so (unsupported, with the
call), instead of train_step failing inside the rank: verl_step.release_blocker per release,
each in its own interpreter (one peer per process)."""

from __future__ import annotations

import ast
import subprocess
import sys

import pytest

from rlaudit.targets.peers.install import peers_dir
from peer_cli import REPO

PROBE = """
from rlaudit.targets.peers.registry import activate
activate("verl", {version!r})
from rlaudit.targets.peers.verl_step import engines_of, release_blocker
print(repr({{e: release_blocker(e, impl) for e, impl in engines_of().items()}}))
"""


def _blockers(version: str) -> dict:
    if not (peers_dir() / f"verl-{version}" / "verl" / "__init__.py").is_file():
        pytest.skip(f"verl {version} is not installed under the peers directory (make peers, "
                    "or make peers-matrix for the older releases)")
    out = subprocess.run([sys.executable, "-c", PROBE.format(version=version)], cwd=REPO,
                         capture_output=True, text=True, timeout=300, check=True).stdout
    return ast.literal_eval(out.strip().splitlines()[-1])


@pytest.mark.parametrize("version", ["0.9.1", "0.7.1"])
def test_the_pinned_releases_are_not_blocked(version):
    assert set(_blockers(version).values()) == {None}


def test_090_needs_flash_attn_for_its_padding_helpers():
    got = _blockers("0.9.0")
    assert "attention_utils.py" in got["fsdp"] and "flash_attn" in got["fsdp"]


def test_050_has_no_dataclass_configs_for_its_legacy_actors():
    got = _blockers("0.5.0")
    assert got and all("verl.workers.config" in why for why in got.values())
