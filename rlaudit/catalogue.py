"""Registry names, invariant docs and backend availability without importing torch (1.3 s) or
megatron (4 s): what ``rlaudit list``, scenario/config validation and input errors need.

The first call in a given installation computes them from the live registries (each section by
its owner's ``catalogue_section()``: rlaudit.algo.names, rlaudit.scenarios.invariants,
rlaudit.backends.registry; see :data:`OWNERS`) and caches the result in
``$RLAUDIT_CACHE_DIR`` (default ``~/.cache/rlaudit``) under a fingerprint of rlaudit's source
files (path, size, mtime), the Python version and the installed torch, megatron-core and
transformers versions; later calls read the file. Editing any rlaudit module or upgrading one of
those packages changes the fingerprint, so the cache cannot go stale; it is never required
(an unwritable cache directory just means computing every time).

    catalogue.algo_names().ADV_ESTIMATORS.get("grpo")   # raises UnknownNameError like a Registry
    catalogue.invariants().get("backend-parity")
    catalogue.invariant_docs()   # [{"name", "family", "doc"}, ...]
    catalogue.algorithms()       # {"advantage estimators": [...], ...}
    catalogue.backends()         # [{"name", "available", "why"}, ...]
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import json
import os
import sys
import tempfile
from importlib import metadata
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from rlaudit import switches
from rlaudit.errors import UnknownNameError

#: Installed packages whose versions enter the fingerprint (they decide backend availability).
PACKAGES = ("torch", "megatron-core", "transformers")
_PACKAGE_ROOT = Path(__file__).resolve().parent


class NameList:
    """The lookup half of a Registry: ``get`` validates a name, ``names`` lists them."""

    def __init__(self, kind: str, names: list[str]):
        self.kind, self._names = kind, sorted(names)

    def get(self, name: object, *, source: str | None = None, key: str | None = None) -> str:
        if isinstance(name, str) and name in self._names:
            return name
        raise UnknownNameError(self.kind, name, self._names, source=source, key=key)

    def names(self) -> list[str]:
        return list(self._names)

    def __contains__(self, name: object) -> bool:
        return name in self._names


def algo_names() -> SimpleNamespace:
    """``ADV_ESTIMATORS``, ``KL_ESTIMATORS``, ... as in rlaudit.algo.names, as NameLists."""
    data = _section("algo")
    return SimpleNamespace(**{attr: NameList(entry["kind"], entry["names"])
                              for attr, entry in data.items()})


def algorithms() -> dict[str, list[str]]:
    """``rlaudit list algorithms``: display kind -> names (aliases included)."""
    return {entry["display"]: entry["names"] for entry in _section("algo").values()}


def invariants() -> NameList:
    return NameList("invariant", [i["name"] for i in invariant_docs()])


def invariant_docs() -> list[dict[str, str]]:
    return _section("invariants")


def backends() -> list[dict[str, Any]]:
    return _section("backends")


# ---- computing the sections from their owners ----------------------------------------------------

#: Which module computes each section, by dotted name: the one named-plugin lookup in rlaudit.
#: Each owner lives on a floor above this one (the registries, the invariants, the backends) and
#: defines ``catalogue_section()``; naming it here and importing it only on a cache miss keeps
#: this floor-0 module from importing upward (an import circle through config) and keeps torch
#: out of ``rlaudit list`` whenever the cache is warm.
OWNERS = {
    "algo": "rlaudit.algo.names",
    "invariants": "rlaudit.scenarios.invariants",
    "backends": "rlaudit.backends.registry",
}


def _compute(name: str) -> Any:
    return importlib.import_module(OWNERS[name]).catalogue_section()


# ---- the cache ------------------------------------------------------------------------------------

def _section(name: str) -> Any:
    data = _load()
    if name not in data:
        data[name] = _compute(name)
        _store(data)
    return data[name]


@functools.lru_cache(maxsize=1)
def fingerprint(root: Path = _PACKAGE_ROOT) -> str:
    """sha256 over rlaudit's source files (relative path, size, mtime), Python and PACKAGES."""
    digest = hashlib.sha256(sys.version.encode())
    for pkg in PACKAGES:
        try:
            digest.update(f"{pkg}={metadata.version(pkg)}".encode())
        except metadata.PackageNotFoundError:
            digest.update(f"{pkg}=none".encode())
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
        for f in sorted(filenames):
            if f.endswith(".py"):
                st = os.stat(os.path.join(dirpath, f))
                rel = os.path.relpath(os.path.join(dirpath, f), root)
                digest.update(f"{rel}:{st.st_size}:{st.st_mtime_ns}\0".encode())
    return digest.hexdigest()[:20]


def cache_dir() -> Path:
    env = switches.cache_dir()
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "rlaudit"


_memo: dict[str, dict] = {}


def _path() -> Path:
    return cache_dir() / f"catalogue-{fingerprint()}.json"


def _load() -> dict:
    path = _path()
    if str(path) not in _memo:
        try:
            _memo[str(path)] = json.loads(path.read_text())
        except (OSError, ValueError):
            _memo[str(path)] = {}
    return _memo[str(path)]


def _store(data: dict) -> None:
    """Write atomically; remove catalogues of other fingerprints. Failure is fine (no cache)."""
    path = _path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".catalogue-", suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(data, f)
        os.replace(tmp, path)
        for old in path.parent.glob("catalogue-*.json"):
            if old != path:
                old.unlink(missing_ok=True)
    except OSError:
        pass
