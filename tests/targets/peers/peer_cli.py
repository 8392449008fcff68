"""Running `rlaudit run --target <peer> --json` in a subprocess, as a user does."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]


def run_cli(tmp_path, target: str, driver: str | None = None) -> tuple[int, dict, str]:
    """``rlaudit run --target <target> --json``: (exit code, {check: result}, stderr)."""
    argv = ["run", "--target", target, "--json", "--no-mlflow",
            "--report-dir", str(tmp_path / "reports")]
    cmd = ([sys.executable, "-c", driver, *argv] if driver else
           [sys.executable, "-m", "rlaudit.cli.main", *argv])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]))
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode in (0, 1), proc.stderr[-3000:]
    checks = {c["invariant"]: c for r in json.loads(proc.stdout) for c in r["checks"]}
    return proc.returncode, checks, proc.stderr


def statuses(checks: dict) -> dict[str, str]:
    return {name: c["status"] for name, c in checks.items()}
