"""Install the pinned peers (``make peers``): one ``pip install --target`` directory per peer.

    python -m rlaudit.targets.peers.install                 # every requirements/peers/*.txt
    python -m rlaudit.targets.peers.install verl-0.9.1      # only these
    python -m rlaudit.targets.peers.install --list          # what is pinned, what is installed

For every ``requirements/peers/<name>-<version>.txt`` this runs
``pip install --no-deps --target <peers dir>/<name>-<version> -r <file>`` with the running
interpreter (``<peers dir>``: :func:`rlaudit.targets.peers.peers_dir`), or the same with
``uv pip install`` where the environment has uv (:func:`install_command`). Peers' own dependency
lists pull CUDA builds of torch and pins that conflict with the CPU environment, so nothing is
resolved: each file pins (``==``) the peer plus only the packages its imported modules need that
the environment lacks. After installing, every top-level module of the new directory is checked
against the environment: one the environment already has (torch, numpy, transformers, ...) would
shadow it once the directory is first on ``sys.path``, so that is an error naming the file.

Some wheels ship stray top-level packages (verl's wheel has ``tests`` and ``scripts``, which would
shadow the repository's own ``tests`` package): a line ``#! drop: tests scripts`` in the
requirements file removes those top-level entries after pip ran.

A peer whose wheel declares a newer Python than the environment's, but whose imported modules run
on it (SkyRL declares >= 3.12), says so with ``#! pip: --ignore-requires-python`` (the only pip
option a requirements file may add: :data:`PIP_OPTIONS`).

Idempotent: a stamp file holds the hash of the requirements file (and of the interpreter's
version and platform, since some pinned wheels are compiled); when it matches, nothing runs.
Atomic: pip installs into a temporary directory beside the target, which is renamed into place
only when everything succeeded; an interrupted run leaves the previous install untouched.
A lock file serialises concurrent runs on one peers directory.

Peers not on the package index (slime, ``snapshots.py``) are pinned as commits in
``requirements/peers/<name>.git`` (``url:``, ``package:``, one ``commit:`` line per snapshot). A
commit already found where the adapter looks (:func:`rlaudit.targets.peers.source_snapshot`) is left
alone; otherwise that one commit is fetched (``git fetch --depth 1``) and its package extracted,
atomically, into ``<peers dir>/<name>-<first 9 characters>``. When the fetch fails (no network), a
run over every peer says so and goes on (those peers' tests skip naming where they looked); a run
that named the peer fails.

Exit codes: 0 done, 1 pip or git failed or the installed directory would shadow the environment,
2 bad input (unknown name, a requirement that is not pinned with ``==``).
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from rlaudit.errors import InputError
from rlaudit.targets.peers.registry import peers_dir
from rlaudit.targets.peers.snapshots import (REQUIREMENTS, STAMP, fetch, found_elsewhere,
                                             pinned_snapshots)

_FILE_NAME = re.compile(r"^(?P<name>[a-z][a-z0-9_]*)-(?P<version>[0-9][0-9A-Za-z.+]*)\.txt$")
_DROP = re.compile(r"^#!\s*drop:\s*(?P<names>.*)$")
_PIP = re.compile(r"^#!\s*pip:\s*(?P<options>.*)$")
#: pip options a requirements file may add with ``#! pip: ...``
PIP_OPTIONS = ("--ignore-requires-python",)
_PINNED = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._\-]*(\[[A-Za-z0-9,._\-]+\])?==[0-9A-Za-z.+!\-]+$")


@dataclass(frozen=True)
class Peer:
    """One pinned peer: ``<name>-<version>`` and its requirements file."""

    name: str
    version: str
    requirements: Path

    @property
    def key(self) -> str:
        return f"{self.name}-{self.version}"

    @property
    def target(self) -> Path:
        return peers_dir() / self.key

    def digest(self) -> str:
        """sha256 of the requirements file, the interpreter's version and its platform."""
        h = hashlib.sha256(self.requirements.read_bytes())
        h.update(f"\0{sys.version_info[0]}.{sys.version_info[1]}\0{sysconfig.get_platform()}"
                 .encode())
        return h.hexdigest()

    def up_to_date(self) -> bool:
        stamp = self.target / STAMP
        return stamp.is_file() and stamp.read_text().strip() == self.digest()


def pinned_peers(requirements: Path | None = None) -> list[Peer]:
    """Every ``<name>-<version>.txt`` under ``requirements`` (default :data:`REQUIREMENTS`),
    validated (each requirement line pinned with ``==``; the first one is the peer itself)."""
    requirements = REQUIREMENTS if requirements is None else requirements
    peers = []
    for path in sorted(requirements.glob("*.txt")):
        m = _FILE_NAME.match(path.name)
        if m is None:
            raise InputError(f"expected <name>-<version>.txt (e.g. verl-0.9.1.txt), got "
                             f"{path.name!r}", source=str(path))
        peer = Peer(m["name"], m["version"], path)
        reqs = _requirements(path)
        first = reqs[0] if reqs else ""
        if not re.match(rf"^{re.escape(peer.name)}(\[[^\]]*\])?=={re.escape(peer.version)}$",
                        first, re.IGNORECASE):
            raise InputError(f"the first requirement must be {peer.name}=={peer.version} (the "
                             f"file's name), got {first!r}", source=str(path))
        pip_options(path), dropped(path)          # directives checked before anything runs
        peers.append(peer)
    return peers


def _requirements(path: Path) -> list[str]:
    """The requirement lines of ``path`` (comments and blanks dropped), each checked to be
    ``name==version``: an unpinned line would let pip pick something else next month."""
    out = []
    for n, raw in enumerate(path.read_text().splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        if not _PINNED.match(line):
            raise InputError(f"line {n}: expected a pinned requirement NAME==VERSION, got "
                             f"{line!r}", source=str(path))
        out.append(line)
    return out


def dropped(path: Path) -> list[str]:
    """Top-level entries the ``#! drop: a b`` lines of ``path`` ask to remove after install."""
    names = []
    for raw in path.read_text().splitlines():
        m = _DROP.match(raw.strip())
        if m:
            names += m["names"].split()
    bad = [n for n in names if not re.fullmatch(r"[A-Za-z0-9_.\-]+", n) or n in (".", "..")]
    if bad:
        raise InputError(f"'#! drop:' expects top-level names, got {bad}", source=str(path))
    return names


def pip_options(path: Path) -> list[str]:
    """Extra pip options the ``#! pip: ...`` lines of ``path`` ask for (:data:`PIP_OPTIONS`)."""
    options = []
    for raw in path.read_text().splitlines():
        m = _PIP.match(raw.strip())
        if m:
            options += m["options"].split()
    bad = [o for o in options if o not in PIP_OPTIONS]
    if bad:
        raise InputError(f"'#! pip:' accepts {', '.join(PIP_OPTIONS)}, got {bad}",
                         source=str(path))
    return options


def select(peers: list[Peer], names: list[str], snapshots: list | None = None):
    """The peers named ``<name>-<version>`` (or just ``<name>``: every pinned version). With
    ``snapshots`` (:func:`pinned_snapshots`), a pair: the pip peers and the snapshots named."""
    shots_in = [] if snapshots is None else snapshots
    chosen, snaps = ([], []) if names else (list(peers), list(shots_in))
    for name in names:
        hits = [p for p in peers if name in (p.key, p.name)]
        shots = [s for s in shots_in if name in (s.key, s.name)]
        if not hits and not shots:
            pinned = [p.key for p in peers] + [s.key for s in shots_in]
            raise InputError(f"no requirements/peers/{name}.txt (or .git); pinned: "
                             f"{', '.join(pinned) or 'none'}", key="NAME-VERSION")
        chosen += [p for p in hits if p not in chosen]
        snaps += [s for s in shots if s not in snaps]
    return chosen if snapshots is None else (chosen, snaps)


@contextlib.contextmanager
def _locked(root: Path):
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def top_level_modules(directory: Path) -> set[str]:
    """Importable top-level names a ``pip install --target`` directory provides."""
    names = set()
    for entry in directory.iterdir():
        if entry.name.startswith(".") or entry.name in ("bin", "__pycache__"):
            continue
        if entry.suffix in (".dist-info", ".egg-info", ".data") or entry.suffix == ".pth":
            continue
        if entry.is_dir() and (entry / "__init__.py").is_file():
            names.add(entry.name)
        elif entry.is_dir():
            names.add(entry.name)                       # namespace package
        elif entry.suffix in (".py", ".so", ".pyd"):
            names.add(entry.name.split(".", 1)[0])
    return names


def shadowed(directory: Path) -> list[str]:
    """Top-level modules of ``directory`` that this environment can already import (they would
    shadow the environment's copy: a CUDA torch over the CPU one, an older numpy, ...)."""
    found = []
    for name in sorted(top_level_modules(directory)):
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            spec = None
        if spec is not None and not _inside(spec, directory):
            found.append(name)
    return found


def _inside(spec, directory: Path) -> bool:
    locations = [spec.origin] if spec.origin else []
    locations += list(spec.submodule_search_locations or [])
    root = str(directory.resolve())
    return any(str(loc).startswith(root) for loc in locations if loc)


def _size(directory: Path) -> int:
    return sum(f.stat().st_size for f in directory.rglob("*") if f.is_file())


def uv_beside_interpreter() -> Path | None:
    """The ``uv`` installed in the running interpreter's environment (``make venv`` puts it
    there), if any."""
    uv = Path(sys.executable).parent / "uv"
    return uv if uv.is_file() and os.access(uv, os.X_OK) else None


def install_command(peer: Peer, target: Path, *, quiet: bool = True) -> list[str]:
    """The command that installs ``peer``'s requirements file, unresolved (``--no-deps``), into
    ``target``: uv when the environment has it (~0.4 s a peer from its cache, where pip takes
    ~4 s), else pip. A file with ``#! pip:`` options (``--ignore-requires-python``, which uv has
    no equivalent of) always goes to pip. Neither compiles bytecode: only the modules imported
    get compiled, on first import."""
    options = pip_options(peer.requirements)
    uv = None if options else uv_beside_interpreter()
    if uv is not None:
        cmd = [str(uv), "pip", "install", "--no-deps", "--python", sys.executable,
               "--target", str(target), "-r", str(peer.requirements)]
    else:
        cmd = [sys.executable, "-m", "pip", "install", "--no-deps",
               "--disable-pip-version-check", "--no-input", "--no-compile", *options,
               "--target", str(target), "-r", str(peer.requirements)]
    if quiet:
        cmd.insert(cmd.index("install") + 1, "-q")
    return cmd


def install(peer: Peer, *, quiet: bool = True) -> str:
    """Install ``peer`` unless its stamp matches; returns a one-line summary."""
    if peer.up_to_date():
        return f"{peer.key}: up to date ({peer.target})"
    t0 = time.perf_counter()
    root = peers_dir()
    tmp = root / f".tmp-{peer.key}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    cmd = install_command(peer, tmp, quiet=quiet)
    try:
        proc = subprocess.run(cmd, capture_output=quiet, text=True)
        if proc.returncode != 0:
            tail = ((proc.stdout or "") + (proc.stderr or ""))[-2000:] if quiet else ""
            tool = "uv" if cmd[0] != sys.executable else "pip"
            raise RuntimeError(f"{peer.key}: {tool} failed (exit {proc.returncode}) installing "
                               f"{peer.requirements}:\n{tail}")
        for name in dropped(peer.requirements):
            entry = tmp / name
            if entry.is_dir():
                shutil.rmtree(entry)
            elif entry.exists():
                entry.unlink()
        bad = shadowed(tmp)
        if bad:
            raise RuntimeError(f"{peer.key}: {peer.requirements} installs {', '.join(bad)}, "
                               f"which this environment already has: the copy in {peer.target} "
                               f"would shadow it (remove it from the file)")
        (tmp / STAMP).write_text(peer.digest() + "\n")
        old = root / f".old-{peer.key}-{os.getpid()}"
        if peer.target.exists():
            peer.target.rename(old)
        tmp.rename(peer.target)
        shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return (f"{peer.key}: installed in {time.perf_counter() - t0:.1f} s, "
            f"{_size(peer.target) / 2**20:.0f} MiB ({peer.target})")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rlaudit.targets.peers.install",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", metavar="NAME-VERSION",
                        help="peers to install (default: every requirements/peers/*.txt)")
    parser.add_argument("--list", action="store_true", help="list pinned peers and exit")
    parser.add_argument("-v", "--verbose", action="store_true", help="show pip's output")
    args = parser.parse_args(argv)
    try:
        peers, snapshots = select(pinned_peers(), args.names, pinned_snapshots(REQUIREMENTS))
    except InputError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.list:
        for p in peers:
            state = "installed" if p.up_to_date() else "not installed (or stale)"
            print(f"{p.key}: {state} ({p.target})")
        for snap in snapshots:
            where = snap.target if snap.up_to_date() else found_elsewhere(snap)
            print(f"{snap.key}: {'found in ' + str(where) if where else 'not fetched'}")
        return 0
    with _locked(peers_dir()):
        # each peer is its own pip process into its own directory: they run side by side
        # (pip is mostly CPU: one per core), reported in the files' order
        with ThreadPoolExecutor(max(1, min(len(peers), os.cpu_count() or 1))) as pool:
            jobs = [pool.submit(install, peer, quiet=not args.verbose) for peer in peers]
            failed = False
            for job in jobs:
                try:
                    print(job.result(), flush=True)
                except RuntimeError as e:
                    print(f"error: {e}", file=sys.stderr)
                    failed = True
        if failed:
            return 1
        unreachable: dict[str, str] = {}
        for snap in snapshots:
            try:
                if snap.url in unreachable and not snap.up_to_date() and \
                        found_elsewhere(snap) is None:
                    raise RuntimeError(f"{snap.key}: not tried, {snap.url} failed above")
                print(fetch(snap), flush=True)
            except RuntimeError as e:
                unreachable[snap.url] = str(e)
                if args.names:
                    print(f"error: {e}", file=sys.stderr)
                    return 1
                print(f"warning: {e}; its tests will skip (docs/peers.md says where a "
                      f"snapshot can be put by hand)", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
