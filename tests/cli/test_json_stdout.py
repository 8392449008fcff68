"""``rlaudit run --target ... --json``: stdout is the JSON alone, whatever the target prints
(Python's print and raw writes to file descriptor 1 alike); what it printed is on stderr."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rlaudit.algo.kl import kl_penalty

REPO = Path(__file__).resolve().parents[2]
MARK_PRINT, MARK_FD = "{'loss': 0.1, 'printed': 'by the trainer'}", "raw bytes on fd 1"


class Chatty:
    """kl_penalty that prints like a trainer logging its dicts, and writes to fd 1 directly."""

    name = "chatty"

    def kl_penalty(self, *, log_prob, ref_log_prob, kind):
        print(MARK_PRINT)
        os.write(1, (MARK_FD + "\n").encode())
        return kl_penalty(log_prob, ref_log_prob, kind)


@pytest.mark.slow
def test_json_stdout_stays_pure_when_the_target_prints(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(Path(__file__).parent),
                                                         os.environ.get("PYTHONPATH", "")])}
    p = subprocess.run(
        [sys.executable, "-c", "import sys; from rlaudit.cli.main import main; sys.exit(main())",
         "run", "--target", "test_json_stdout:Chatty", "--json", "--no-mlflow",
         "--report-dir", str(tmp_path / "reports"), "--scenarios-dir", str(REPO / "scenarios")],
        capture_output=True, text=True, timeout=300, cwd=REPO, env=env)
    results = json.loads(p.stdout)          # nothing but the JSON
    assert results[0]["scenario"] == "stages"
    statuses = {c["invariant"]: c["status"] for c in results[0]["checks"]}
    assert statuses["kl_penalty:parity"] == "pass"
    assert MARK_PRINT in p.stderr and MARK_FD in p.stderr
    assert MARK_PRINT not in p.stdout and MARK_FD not in p.stdout
    assert p.returncode == 0, p.stderr[-2000:]
