"""`rlaudit run --target areal areal_one_minibatch`: the run-level checks apply to AReaL's own
step (one PPO epoch, one mini-batch: the shape AReaL's ``_ppo_update`` has) and pass on the pinned
release. On every other shipped scenario AReaL's column is n/a (epochs, several mini-batches),
so this is where a regression of its update would show as a red rather than stay invisible."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from rlaudit.targets.peers import peers_dir

from peer_cli import REPO

PINNED = "1.0.4"
#: every invariant of the scenario, each of which must have run on AReaL (not n/a) and passed
INVARIANTS = {"backend-parity", "on-policy-identities", "grad-norm-identity",
              "microbatch-invariance", "padding-appended", "masked-values", "rollout-parity",
              "sanity-bounds", "no-input-mutation"}

pytestmark = pytest.mark.slow


def test_areal_run_level_checks_apply_and_pass(tmp_path):
    if not (peers_dir() / f"areal-{PINNED}" / "areal" / "__init__.py").is_file():
        pytest.skip(f"areal=={PINNED} is not installed under {peers_dir()} (run `make peers`)")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]))
    proc = subprocess.run(
        [sys.executable, "-m", "rlaudit.cli.main", "run", "--target", f"areal=={PINNED}",
         "areal_one_minibatch", "--json", "--no-mlflow", "--report-dir", str(tmp_path / "r")],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (scenario,) = [r for r in json.loads(proc.stdout) if r["scenario"] == "areal_one_minibatch"]
    areal = {c["invariant"]: c["status"] for c in scenario["checks"]
             if c["backend"] != "reference"}
    assert areal == {name: "pass" for name in INVARIANTS}, areal
