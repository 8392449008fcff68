"""Peers not on the package index (slime), pinned as commits in
``requirements/peers/<name>.git`` (``url:``, ``package:``, one ``commit:`` line per snapshot):
reading the pins and fetching one commit's package into the peers directory (``make peers``,
see install.py).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from rlaudit.errors import InputError
from rlaudit.targets.peers.registry import SNAPSHOT_PEERS, peers_dir, source_snapshot

#: where the pinned requirement files live, relative to the repository root
REQUIREMENTS = Path(__file__).resolve().parents[3] / "requirements" / "peers"
#: file in an installed peer directory holding the hash (or commit) it was built from
STAMP = ".rlaudit-installed"
#: how long one git call of a snapshot fetch may take before it counts as failed (a firewall
#: that drops packets would otherwise hold `make test` for git's own connect timeouts); after a
#: failed fetch, the other commits of that URL are not tried in the same run
FETCH_TIMEOUT_S = 90
_GIT_KEY = re.compile(r"^(?P<key>url|package|commit):\s*(?P<value>\S+)\s*$")


@dataclass(frozen=True)
class Snapshot:
    """One pinned commit of a peer published only as source (``requirements/peers/<name>.git``)."""

    name: str
    url: str
    package: str
    commit: str
    source: Path

    @property
    def short(self) -> str:
        return self.commit[:9]

    @property
    def key(self) -> str:
        return f"{self.name}-{self.short}"

    @property
    def target(self) -> Path:
        return peers_dir() / self.key

    def up_to_date(self) -> bool:
        stamp = self.target / STAMP
        return stamp.is_file() and stamp.read_text().strip() == self.commit


def pinned_snapshots(requirements: Path | None = None) -> list[Snapshot]:
    """Every commit pinned by a ``<name>.git`` file under ``requirements``, validated."""
    requirements = REQUIREMENTS if requirements is None else requirements
    out = []
    for path in sorted(requirements.glob("*.git")):
        name = path.stem
        if not re.fullmatch(r"[a-z][a-z0-9_]*", name):
            raise InputError(f"expected <name>.git (e.g. slime.git), got {path.name!r}",
                             source=str(path))
        values: dict[str, list[str]] = {"url": [], "package": [], "commit": []}
        for n, raw in enumerate(path.read_text().splitlines(), start=1):
            line = raw.split("#", 1)[0].strip()
            if not line:
                continue
            m = _GIT_KEY.match(line)
            if m is None:
                raise InputError(f"line {n}: expected 'url: URL', 'package: NAME' or "
                                 f"'commit: SHA', got {line!r}", source=str(path))
            values[m["key"]].append(m["value"])
        for key in ("url", "package"):
            if len(values[key]) != 1:
                raise InputError(f"expected exactly one '{key}:' line, got {len(values[key])}",
                                 source=str(path), key=key)
        bad = [c for c in values["commit"] if not re.fullmatch(r"[0-9a-f]{40}", c)]
        if bad or not values["commit"]:
            raise InputError(f"expected one or more 'commit:' lines holding a full 40-character "
                             f"sha (a short one could become ambiguous), got {bad or 'none'}",
                             source=str(path), key="commit")
        out += [Snapshot(name, values["url"][0], values["package"][0], c, path)
                for c in values["commit"]]
    return out


def found_elsewhere(snap: Snapshot) -> Path | None:
    """Where the adapter already finds ``snap`` outside the peers directory, if anywhere."""
    if snap.name not in SNAPSHOT_PEERS:
        return None
    try:
        path, _ = source_snapshot(snap.name, snap.short)
    except InputError:
        return None
    return path if path is not None and path.resolve() != snap.target.resolve() else None


def _git(args: list[str], cwd: Path) -> str:
    proc = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=FETCH_TIMEOUT_S,
                          env={**os.environ, "GIT_TERMINAL_PROMPT": "0"})
    if proc.returncode != 0:
        verb = next(a for a in args if not a.startswith("-") and "=" not in a)
        raise RuntimeError(f"git {verb} failed (exit {proc.returncode}): "
                           f"{(proc.stderr or proc.stdout).strip()[-1000:]}")
    return proc.stdout


def fetch(snap: Snapshot) -> str:
    """Extract ``snap``'s package at its commit into its peers directory unless it is there or
    the adapter finds it elsewhere; returns a one-line summary. Raises RuntimeError."""
    if snap.up_to_date():
        return f"{snap.key}: up to date ({snap.target})"
    elsewhere = found_elsewhere(snap)
    if elsewhere is not None:
        return f"{snap.key}: found in {elsewhere}"
    t0 = time.perf_counter()
    root = peers_dir()
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".tmp-{snap.key}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    repo = tmp / ".git-fetch"
    try:
        repo.mkdir(parents=True)
        _git(["init", "-q"], repo)
        try:
            _git(["-c", "http.lowSpeedLimit=1000", "-c", "http.lowSpeedTime=30", "fetch", "-q",
                  "--depth", "1", snap.url, snap.commit], repo)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"git fetch of {snap.url} took over {FETCH_TIMEOUT_S} s") from None
        got = _git(["rev-parse", "FETCH_HEAD"], repo).strip()
        if got != snap.commit:
            raise RuntimeError(f"{snap.url} answered {got} for {snap.commit}")
        archive = subprocess.run(["git", "archive", "--format=tar", snap.commit, snap.package],
                                 cwd=repo, capture_output=True, timeout=FETCH_TIMEOUT_S)
        if archive.returncode != 0:
            raise RuntimeError(f"{snap.commit} has no {snap.package}/ ({snap.source}): "
                               f"{archive.stderr.decode(errors='replace').strip()[-500:]}")
        subprocess.run(["tar", "-x", "-C", str(tmp)], input=archive.stdout, check=True,
                       timeout=FETCH_TIMEOUT_S)
        shutil.rmtree(repo)
        if not (tmp / snap.package / "__init__.py").is_file():
            raise RuntimeError(f"{snap.commit}: {snap.package}/__init__.py missing")
        (tmp / STAMP).write_text(snap.commit + "\n")
        old = root / f".old-{snap.key}-{os.getpid()}"
        if snap.target.exists():
            snap.target.rename(old)
        tmp.rename(snap.target)
        shutil.rmtree(old, ignore_errors=True)
    except (OSError, subprocess.SubprocessError) as e:
        raise RuntimeError(f"{snap.key}: {e}") from None
    except RuntimeError as e:
        raise RuntimeError(f"{snap.key}: {e}") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return (f"{snap.key}: fetched {snap.commit} from {snap.url} in "
            f"{time.perf_counter() - t0:.1f} s ({snap.target})")
