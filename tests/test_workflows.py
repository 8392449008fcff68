"""The GitHub workflow files: valid against the GitHub workflow JSON schema pinned in
check-jsonschema (a dev dependency; actionlint has no wheel on PyPI), and doing what the README
says: CI runs the README's test command, the nightly runs the GPU suite through Ray and keeps
its report."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
WORKFLOWS = sorted((REPO / ".github" / "workflows").glob("*.yml"))


def _lint(*paths: Path) -> subprocess.CompletedProcess:
    pytest.importorskip("check_jsonschema", reason="check-jsonschema is a dev dependency "
                                                   "(pip install -e '.[dev]')")
    return subprocess.run([sys.executable, "-m", "check_jsonschema", "--builtin-schema",
                           "vendor.github-workflows", *map(str, paths)],
                          capture_output=True, text=True, timeout=120)


def _steps(path: Path) -> list[dict]:
    data = yaml.safe_load(path.read_text())
    return [s for job in data["jobs"].values() for s in job["steps"]]


def test_workflows_pass_the_schema():
    assert {p.name for p in WORKFLOWS} >= {"ci.yml", "nightly-gpu.yml"}
    out = _lint(*WORKFLOWS)
    assert out.returncode == 0, out.stdout + out.stderr


def test_the_linter_rejects_a_broken_workflow(tmp_path):
    data = yaml.safe_load((REPO / ".github" / "workflows" / "ci.yml").read_text())
    job = data["jobs"]["test"]
    job["runs_on"] = job.pop("runs-on")          # a misspelt key
    job["timeout-minutes"] = "forty-five"        # a wrong type
    broken = tmp_path / "broken.yml"
    broken.write_text(yaml.safe_dump(data))
    out = _lint(broken)
    assert out.returncode != 0 and "runs" in out.stdout + out.stderr


def test_ci_runs_the_readme_test_command():
    runs = [s.get("run", "") for s in _steps(REPO / ".github" / "workflows" / "ci.yml")]
    assert "bash .ci/run" in runs
    assert "make test" in (REPO / ".ci" / "run").read_text()
    assert "make test" in (REPO / "README.md").read_text()


def test_nightly_gpu_workflow():
    path = REPO / ".github" / "workflows" / "nightly-gpu.yml"
    data = yaml.safe_load(path.read_text())
    (job,) = data["jobs"].values()
    assert "self-hosted" in job["runs-on"] and "gpu" in job["runs-on"]
    assert job["env"]["MLFLOW_TRACKING_URI"] == "${{ secrets.MLFLOW_TRACKING_URI }}"
    runs = [s.get("run", "") for s in job["steps"]]
    assert any("make venv-gpu" in r for r in runs)
    assert any("make nightly-gpu EXECUTOR=ray" in r for r in runs)
    summary = next(s for s in job["steps"] if "GITHUB_STEP_SUMMARY" in s.get("run", ""))
    assert summary["if"] == "always()" and "rlaudit report" in summary["run"]
    upload = next(s for s in job["steps"] if s.get("uses", "").startswith("actions/upload-artifact"))
    assert upload["if"] == "always()" and "reports/latest/" in upload["with"]["path"]
    makefile = (REPO / "Makefile").read_text()
    target = makefile.split("\nnightly-gpu:")[1].split("\n\n")[0]
    assert "--executor $(EXECUTOR)" in target and "--device cuda" in target
