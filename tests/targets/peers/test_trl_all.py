"""`rlaudit run --target trl==V --all` exits 0 on every pinned TRL release installed under the
peers directory: every shipped scenario replayed through TRL's real GRPOTrainer, no undeclared
failure. (Before rollout-correction honoured ``metric_reduction`` it exited 1 on every release,
through the reference's own check in rollout_kl_loss.) Skipped for releases not installed; one
subprocess per release, as a user runs it (~5 min each on a loaded 2-core box)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from rlaudit.targets.peers import installed_versions

from peer_cli import REPO

#: the releases requirements/peers/ pins for TRL
PINNED = ("1.14.2", "1.16.0")

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("version", PINNED)
def test_all_scenarios_exit_0(version, tmp_path):
    if version not in installed_versions("trl"):
        pytest.skip(f"TRL {version} is not installed under the peers directory (make peers)")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]))
    proc = subprocess.run(
        [sys.executable, "-m", "rlaudit.cli.main", "run", "--target", f"trl=={version}", "--all",
         "--no-mlflow", "--report-dir", str(tmp_path / "reports")],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=1500)
    tail = proc.stdout[-3000:] + proc.stderr[-1500:]
    assert proc.returncode == 0, tail
    assert "scenarios passed" in proc.stdout and "FAILED" not in proc.stdout, tail
