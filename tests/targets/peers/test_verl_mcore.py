"""verl 0.9.1's Megatron engine on the CPU (rlaudit.targets.peers.verl_mcore): the column says
unsupported with the call of verl that stops it, found by running verl's own config code."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from rlaudit.targets.peers import peers_dir

REPO = Path(__file__).resolve().parents[3]
PEER = peers_dir() / "verl-0.9.1"

pytestmark = pytest.mark.skipif(not (PEER / "verl").is_dir(),
                                reason=f"verl 0.9.1 is not installed under {PEER.parent}")

SCRIPT = """
import sys
sys.path.insert(0, sys.argv[1])
from rlaudit.targets.peers import verl_mcore
from rlaudit.verdict.unsupported import UnsupportedFeature
print(verl_mcore.config_error("bfloat16"))
print(verl_mcore.config_error("float32"))
try:
    verl_mcore.blocked("0.9.1")
except UnsupportedFeature as e:
    print(e.release, "|", e.feature, "|", e.reason)
try:
    verl_mcore.train_steps(None, [], device="cpu")    # the column's path on the CPU
except UnsupportedFeature as e:
    print(e.release, "|", e.feature, "|", e.reason)
from types import SimpleNamespace
from rlaudit.targets.peers.verl_step import VerlEngine
column = VerlEngine(SimpleNamespace(version="0.9.1", dp=1), "megatron", "engine")
try:
    column.replay(SimpleNamespace(device="cpu", variants=[]))
except UnsupportedFeature as e:
    print(e.release, "|", e.feature, "|", e.reason)
"""


def test_megatron_engine_blocked_at_its_config():
    # verl in a child: two verl releases cannot share a process
    p = subprocess.run([sys.executable, "-c", SCRIPT, str(PEER)], capture_output=True,
                       text=True, timeout=300, cwd=REPO)
    assert p.returncode == 0, p.stderr[-3000:]
    bf16, fp32, blocked, steps, replay = p.stdout.strip().splitlines()[-5:]
    assert bf16 == "None"                       # bf16 is what the engine config accepts
    # McoreEngineConfig.__post_init__: assert self.dtype in ["bfloat16", "float16"]
    assert fp32.startswith("verl/workers/config/engine.py:218:") and "float32" in fp32, fp32
    release, feature, reason = (x.strip() for x in blocked.split("|"))
    assert release == "verl 0.9.1" and "float32" in feature
    assert "engine.py:218" in reason and "mbridge/core/util.py:151" in reason
    assert "param_and_grad_buffer.py:783" in reason
    # the column's train_steps and replay on the CPU stop there, before any rank starts
    assert steps == blocked and replay == blocked
