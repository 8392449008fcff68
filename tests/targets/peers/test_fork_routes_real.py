"""docs/peers.md's two routes for auditing a fork of verl, done as the docs say, offline: a fork
(a copy of the pinned verl 0.9.1 with one line changed) installed with pip, then audited.

The line: verl's k2 KL estimator without its ½ (``0.5 * (logprob - ref_logprob).square()``
becomes ``(logprob - ref_logprob).square()``), which ``kl_penalty:parity`` must show red (k2 is
half the squared log-ratio, so every k2 value doubles), while the unchanged line is green.

1. ``pip install -e --no-deps`` of the fork into the environment, then ``--target verl``: the
   fork must win over ``.peers/verl-*`` and import verl's dependencies from there. The
   environment is a throwaway venv layered on the one running the tests (``venv
   --system-site-packages`` would see the base interpreter's packages, not this environment's:
   a ``.pth`` line adds this environment's site directory instead), so pip writes nowhere shared.
   setuptools' default editable install finds the fork through a finder that Python asks after
   ``sys.path``: before ``registry.keep_environment_copy`` the pinned verl appended for the
   dependencies silently won (the audit ran on the release, not the fork).
2. A peers directory of one's own: the pinned directory copied, its verl swapped for the fork with
   ``pip install --no-deps --target``, then ``RLAUDIT_PEERS_DIR=<dir> --target
   verl==0.9.1+mine``.

Each audit runs in its own process (one verl per interpreter) and runs the ``kl_penalty`` stage
only (what ``rlaudit run --target`` runs first, through the same ``load_adapter`` and
``run_stage_checks``; the whole run takes minutes on verl).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from rlaudit.targets.peers import peers_dir

REPO = Path(__file__).resolve().parents[3]
PINNED = peers_dir() / "verl-0.9.1"
CORE = Path("verl/trainer/ppo/core_algos.py")
GOOD = "        return 0.5 * (logprob - ref_logprob).square()\n"
BAD = "        return (logprob - ref_logprob).square()\n"
#: a fork's build file (verl's own setup.py needs git metadata; this builds the same package)
PYPROJECT = """\
[build-system]
requires = ["setuptools"]
build-backend = "setuptools.build_meta"

[project]
name = "verl"
version = "0.9.1+mine"

[tool.setuptools.packages.find]
include = ["verl", "verl.*"]

[tool.setuptools.package-data]
verl = ["version/*", "**/*.yaml", "py.typed"]
"""
#: one audit: the adapter as `--target` loads it, the kl_penalty stage checks, as JSON
AUDIT = """\
import importlib, json, sys
from rlaudit.targets.contract.load import load_adapter
from rlaudit.targets.stages import run_stage_checks
adapter = load_adapter(sys.argv[1])
res = run_stage_checks(adapter, stages=["kl_penalty"])
print(json.dumps({"column": res.backends[0], "verl": importlib.import_module("verl").__file__,
                  "checks": {c.invariant: c.status for c in res.checks}}))
"""
PIP_OFFLINE = ["-m", "pip", "install", "--no-deps", "--no-index", "--no-build-isolation",
               "--disable-pip-version-check", "-q"]

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not (PINNED / "verl").is_dir(), reason=f"verl 0.9.1 is not installed "
                       f"under {PINNED.parent} (run `make peers`)"),
]


def _run(cmd: list, **kw) -> str:
    p = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=600,
                       cwd=REPO, **kw)
    assert p.returncode == 0, f"{' '.join(map(str, cmd))}: exit {p.returncode}\n{p.stderr[-3000:]}"
    return p.stdout


def _fork(root: Path, line: str) -> Path:
    """A verl checkout: the pinned release's package and a build file, ``line`` as k2."""
    shutil.copytree(PINNED / "verl", root / "verl",
                    ignore=shutil.ignore_patterns("__pycache__"))
    (root / "pyproject.toml").write_text(PYPROJECT)
    _set_k2(root, line)
    return root


def _set_k2(fork: Path, line: str) -> None:
    path = fork / CORE
    text = path.read_text()
    current = GOOD if GOOD in text else BAD
    assert text.count(current) == 1, "verl 0.9.1's k2 line is not where this test expects it"
    path.write_text(text.replace(current, line))


def _audit(python: Path | str, spec: str, tmp_path: Path, **env) -> dict:
    script = tmp_path / "audit.py"
    script.write_text(AUDIT)
    full = dict(os.environ, PYTHONPATH=str(REPO), RLAUDIT_TEST_THREADS="1", **env)
    return json.loads(_run([python, script, spec], env=full).strip().splitlines()[-1])


def _layered_venv(root: Path) -> Path:
    """A venv whose own site directory comes first, then this environment's (with its .pth
    files: rlaudit's editable install), so pip installs into the venv only."""
    _run([sys.executable, "-m", "venv", "--without-pip", root])
    site = Path(_run([root / "bin" / "python", "-c",
                      "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).strip())
    parent = sysconfig.get_paths()["purelib"]
    (site / "_rlaudit_parent_env.pth").write_text(f"import site; site.addsitedir({parent!r})\n")
    return root / "bin" / "python"


def test_an_editable_fork_in_the_environment_is_what_gets_audited(tmp_path):
    fork = _fork(tmp_path / "verl-fork", BAD)
    python = _layered_venv(tmp_path / "venv")
    _run([python, *PIP_OFFLINE, "-e", fork])
    red = _audit(python, "verl", tmp_path)
    assert Path(red["verl"]).resolve().is_relative_to(fork.resolve()), red["verl"]
    assert red["checks"]["kl_penalty:parity"] == "fail"
    assert red["checks"]["kl_penalty:no-mutation"] == "pass"
    _set_k2(fork, GOOD)     # an editable install: the fixed line is audited without reinstalling
    green = _audit(python, "verl", tmp_path)
    assert green["checks"] == {"kl_penalty:parity": "pass", "kl_penalty:no-mutation": "pass"}
    assert green["column"] == "verl-0.9.1"


def test_a_fork_in_a_peers_directory_of_its_own_is_found_by_version(tmp_path):
    fork = _fork(tmp_path / "verl-fork", BAD)
    mine = tmp_path / "peers" / "verl-0.9.1+mine"
    shutil.copytree(PINNED, mine, symlinks=True)
    shutil.rmtree(mine / "verl")
    shutil.rmtree(mine / "verl-0.9.1.dist-info")
    _run([sys.executable, *PIP_OFFLINE, "--target", mine, fork])
    assert sorted(p.name for p in mine.glob("verl*")) == ["verl", "verl-0.9.1+mine.dist-info"]
    red = _audit(sys.executable, "verl==0.9.1+mine", tmp_path,
                 RLAUDIT_PEERS_DIR=str(tmp_path / "peers"))
    assert Path(red["verl"]).resolve().is_relative_to(mine.resolve()), red["verl"]
    assert red["checks"]["kl_penalty:parity"] == "fail"
