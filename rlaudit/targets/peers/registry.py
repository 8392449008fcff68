"""Where peers are found and how a short name (``verl``, ``verl==0.7.1``) becomes an adapter.

    rlaudit run --target verl            # the verl found on sys.path, else the newest under .peers/
    rlaudit run --target verl==0.7.1     # <peers dir>/verl-0.7.1 (made by `make peers`)
    rlaudit run --target slime==a0d6d26a2  # a slime source snapshot (not on the package index)

A peer's package is found either as installed in the user's environment (``pip install verl``) or
in ``<peers dir>/<name>-<version>/``, a ``pip install --target`` directory made by ``make peers``
(``<peers dir>`` is ``$RLAUDIT_PEERS_DIR``, default ``<repository>/.peers``). Adapters never
re-implement the peer's code: they convert rlaudit's tensors to the peer's format, call its
functions, and convert back. docs/peers.md says what each covers per version.

slime is not published on the package index: its versions are source snapshots named by commit,
found (:func:`source_snapshot`) through ``$RLAUDIT_SLIME_DIR`` (a slime checkout, e.g. your fork,
or a folder of ``<commit>/`` snapshots), else ``<repository>/../shared/peers/slime/<commit>``,
else ``<peers dir>/slime-<commit>``.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.metadata
import importlib.util
import os
import re
import sys
from pathlib import Path

from rlaudit import switches
from rlaudit.errors import InputError

#: short name -> "module:Attr" of its adapter
PEERS: dict[str, str] = {
    "verl": "rlaudit.targets.peers.verl:VerlAdapter",
    "skyrl": "rlaudit.targets.peers.skyrl:SkyRLAdapter",
    "slime": "rlaudit.targets.peers.slime:SlimeAdapter",
}
PEERS["trl"] = "rlaudit.targets.peers.trl:TRLAdapter"
PEERS["openrlhf"] = "rlaudit.targets.peers.openrlhf:OpenRLHFAdapter"
PEERS["areal"] = "rlaudit.targets.peers.areal:ArealAdapter"

_SPEC = re.compile(r"^(?P<name>[a-z][a-z0-9_-]*)(==(?P<version>[0-9A-Za-z][0-9A-Za-z.+-]*))?$")


def peers_dir() -> Path:
    """Where ``make peers`` installs peers: ``$RLAUDIT_PEERS_DIR`` or ``<repository>/.peers``."""
    env = switches.peers_dir()
    return Path(env) if env else Path(__file__).resolve().parents[3] / ".peers"


def installed_versions(name: str) -> list[str]:
    """Versions of ``name`` under :func:`peers_dir`, oldest first."""
    root = peers_dir()
    if not root.is_dir():
        return []
    found = [p.name[len(name) + 1:] for p in root.iterdir()
             if p.is_dir() and p.name.startswith(name + "-")]
    return sorted(found, key=_version_key)


def _version_key(v: str) -> tuple:
    return tuple(int(x) if x.isdigit() else x for x in re.split(r"[.+-]", v))


def parse(spec: str) -> tuple[str, str | None] | None:
    """``"verl"`` -> ("verl", None); ``"verl==0.7.1"`` -> ("verl", "0.7.1"); None when ``spec``
    is not a short peer name (e.g. ``module:Attr``)."""
    m = _SPEC.match(spec)
    if m is None or m["name"] not in PEERS:
        return None
    return m["name"], m["version"]


def activate(name: str, version: str | None = None) -> str | None:
    """Put ``<peers dir>/<name>-<version>`` first on ``sys.path`` (``version`` None: keep an
    installed copy if importable, else the newest directory). Returns the version activated from
    the peers directory, or None when the environment's own install is used (a fork installed
    with ``pip install -e --no-deps``): the newest peers directory is then appended to
    ``sys.path``, behind everything the environment has, so that the packages ``make peers``
    installed for the peer (verl's tensordict, ...) resolve while the environment's peer wins.
    Peers published only as source snapshots (slime) are found by :func:`source_snapshot`."""
    if name in SNAPSHOT_PEERS:
        path, version = source_snapshot(name, version)
        if path is None:
            return None
        sys.path.insert(0, str(path))
        ACTIVE_SNAPSHOTS[name] = version
        return version
    if version is None:
        versions = installed_versions(name)
        if importlib.util.find_spec(_module_of(name)) is not None:
            keep_environment_copy(_module_of(name))
            if versions and str(peers_dir() / f"{name}-{versions[-1]}") not in sys.path:
                leave_other_peers(peers_dir() / f"{name}-{versions[-1]}")
                sys.path.append(str(peers_dir() / f"{name}-{versions[-1]}"))
                _refresh_probes()
            return None
        if not versions:
            raise InputError(f"peer {name!r} is neither installed nor under {peers_dir()} "
                             f"(run `make peers`, see docs/peers.md)", key="--target")
        version = versions[-1]
    path = peers_dir() / f"{name}-{version}"
    if not path.is_dir():
        have = ", ".join(installed_versions(name)) or "none"
        raise InputError(f"{name}=={version} is not installed under {peers_dir()} (installed: "
                         f"{have}; run `make peers`, see docs/peers.md)", key="--target")
    leave_other_peers(path)
    sys.path.insert(0, str(path))
    _refresh_probes()
    return version


class _FirstFinder:
    """Finds top-level module ``module`` through ``finder`` only, ahead of ``sys.path``."""

    def __init__(self, module: str, finder) -> None:
        self.module, self.finder = module, finder

    def find_spec(self, fullname, path=None, target=None):
        if fullname != self.module:
            return None
        return self.finder.find_spec(fullname, path, target)


def keep_environment_copy(module: str) -> None:
    """Keep the environment's ``module`` ahead of a peers directory appended to ``sys.path``.

    ``pip install -e`` with setuptools' default editable mode installs a finder that
    ``sys.meta_path`` consults *after* ``sys.path``: with the newest ``<peers dir>/verl-*``
    appended for verl's dependencies, the pinned release's ``verl`` would shadow the fork the
    user installed. The finder that finds ``module`` now goes first, for that name only (its
    submodules follow the package's own ``__path__``). A module found through ``sys.path``
    needs nothing: its entry is already ahead of the appended directory."""
    if any(isinstance(f, _FirstFinder) and f.module == module for f in sys.meta_path):
        return
    for finder in sys.meta_path:
        find = getattr(finder, "find_spec", None)
        if find is not None and find(module, None) is not None:
            if finder is not importlib.machinery.PathFinder:
                sys.meta_path.insert(0, _FirstFinder(module, finder))
            return


def leave_other_peers(keep: Path) -> None:
    """One peer directory per process: every other ``<peers dir>/<name>-<version>`` leaves
    ``sys.path``, and the modules imported from one leave ``sys.modules``. Peers pin different
    releases of the same packages (TRL's accelerate, OpenRLHF's accelerate and deepspeed): a
    directory left on the path, or a module left imported, makes the next peer import the other's
    release (transformers imports DeepSpeed glue whenever deepspeed is importable)."""
    roots = {str(peers_dir()), str(peers_dir().resolve())}
    mine = {str(keep), str(keep.resolve())}

    def other(location: str) -> bool:
        return (any(location.startswith(r + os.sep) for r in roots)
                and not any(location == m or location.startswith(m + os.sep) for m in mine))

    sys.path[:] = [p for p in sys.path if not other(p)]
    for name, module in list(sys.modules.items()):
        location = getattr(module, "__file__", None)
        if location and other(location):
            forget_arrow_types(module)
            del sys.modules[name]


def forget_arrow_types(module) -> None:
    """Unregister the pyarrow extension types ``module`` defines. pyarrow's registry is
    process-global and outlives the module: a peer package that registers its types at import
    (datasets' ArrayND types, named ``<module>.<class>``) would fail with ArrowKeyError when the
    next peer imports its own release of that package."""
    pa = sys.modules.get("pyarrow")
    if pa is None:
        return
    for value in list(vars(module).values()):
        if (isinstance(value, type) and issubclass(value, pa.ExtensionType)
                and value.__module__ == module.__name__):
            try:
                pa.unregister_extension_type(f"{value.__module__}.{value.__name__}")
            except (KeyError, pa.ArrowKeyError):
                pass


def _refresh_probes() -> None:
    """After a peers directory joined ``sys.path``: forget the import system's negative caches
    and, when transformers is already imported, its cached ``is_<package>_available()``
    answers (``lru_cache``d at first use: a process that imported transformers before TRL's
    accelerate was on the path would refuse to build a Trainer)."""
    importlib.invalidate_caches()
    probes = sys.modules.get("transformers.utils.import_utils")
    if probes is None:
        return
    for attr in dir(probes):
        fn = getattr(probes, attr)
        if attr.startswith("is_") and attr.endswith("_available") and hasattr(fn, "cache_clear"):
            fn.cache_clear()


#: the top-level module each peer installs (for "is it importable already?")
MODULES: dict[str, str] = {"verl": "verl", "skyrl": "skyrl", "slime": "slime", "trl": "trl",
                           "openrlhf": "openrlhf", "areal": "areal"}

#: how Python says a module lacks a name: ``cannot import name 'X' from 'pkg.mod' (...)``
_MISSING_NAME = re.compile(r"cannot import name '(?P<name>[\w.]+)' from '(?P<module>[\w.]+)'")


def import_advice(e: ImportError) -> str:
    """``e`` and what would fix it: a package the peer needs that is missing is `make peers`'
    job; a name the environment's own package no longer has (a peer release written for an
    older transformers, say) is not, and says so."""
    m = _MISSING_NAME.search(str(e))
    spec = importlib.util.find_spec(m["module"].split(".")[0]) if m else None
    origin = Path(spec.origin).resolve() if spec is not None and spec.origin else None
    peers = peers_dir().resolve()
    # the environment's own package (not a peer, nor anything installed beside one)
    if (origin is not None and peers not in origin.parents
            and spec.name not in MODULES.values()):
        top = spec.name
        try:
            have = f"{top} {importlib.metadata.version(top)}"
        except importlib.metadata.PackageNotFoundError:
            have = top
        return (f"cannot import name {m['name']!r} from {m['module']!r}: the environment's "
                f"{have} has no {m['name']!r}, which this release "
                f"imports; it needs an older {top} (an environment of its own), which `make "
                f"peers` does not install (docs/peers.md)")
    return f"{e} (run `make peers`, see docs/peers.md)"


#: snapshot peer -> the commit (or checkout folder name) :func:`activate` put on ``sys.path``
ACTIVE_SNAPSHOTS: dict[str, str] = {}


def snapshot_column(name: str) -> str:
    """A snapshot peer's report column: ``<name>-<commit>`` as activated, else ``name``."""
    version = ACTIVE_SNAPSHOTS.get(name)
    return f"{name}-{version}" if version else name


#: peers not on the package index, audited from source snapshots: name -> (environment variable
#: naming a checkout or a folder of ``<commit>/`` snapshots, the commit used when none is asked)
SNAPSHOT_PEERS: dict[str, tuple[str, str]] = {
    # 624b824a8: after slime PR #2114 (the stored KL is no longer shaped in place)
    "slime": (switches.SLIME_DIR, "624b824a8"),
}


def _is_checkout(path: Path, module: str) -> bool:
    return (path / module / "__init__.py").is_file()


def source_snapshot(name: str, version: str | None = None) -> tuple[Path | None, str | None]:
    """Where the source of snapshot peer ``name`` (at commit ``version``) is: ``(folder to put
    on sys.path, version)``; ``(None, None)`` when ``version`` is None and the package is already
    importable (installed from git by the user).

    Looked up in order: ``$<ENV>`` (a checkout holding the package, used when no version is
    asked; or a folder of ``<commit>/`` snapshots), ``<repository>/../shared/peers/<name>/
    <commit>``, ``<peers dir>/<name>-<commit>``. Without a version the pinned default commit is
    used. Raises InputError naming every place looked at when none holds it."""
    env_var, default = SNAPSHOT_PEERS[name]
    module = _module_of(name)
    env = switches.read(env_var)
    if env and version is None and _is_checkout(Path(env), module):
        return Path(env), Path(env).name
    if env and version is not None and _is_checkout(Path(env), module) and \
            not (Path(env) / version).is_dir():
        raise InputError(f"${env_var}={env} is one {name} checkout; ask for --target {name} "
                         f"(without ==version) to audit it, or unset ${env_var}",
                         key="--target")
    if version is None and importlib.util.find_spec(module) is not None:
        return None, None
    version = version or default
    roots = ([Path(env) / version] if env else []) + [
        Path(__file__).resolve().parents[3].parent / "shared" / "peers" / name / version,
        peers_dir() / f"{name}-{version}"]
    for path in roots:
        if _is_checkout(path, module):
            return path, version
    raise InputError(f"{name}=={version} not found (looked in: {', '.join(map(str, roots))}); "
                     f"set ${env_var} to a {name} checkout or a folder of <commit>/ snapshots "
                     f"(docs/peers.md)", key="--target")


def _module_of(name: str) -> str:
    return MODULES.get(name, name)


def resolve(spec: str) -> str | None:
    """``"verl==0.7.1"`` -> the adapter's ``module:Attr`` after activating that version; None when
    ``spec`` is not a short peer name."""
    parsed = parse(spec)
    if parsed is None:
        return None
    name, version = parsed
    activate(name, version)
    return PEERS[name]
