"""docs/peers.md's fork routes, on stand-ins: a fork importable from the environment (``pip
install -e --no-deps``, through a ``sys.path`` entry or through an import finder as setuptools'
editable installs make) keeps winning, and still finds the packages ``make peers`` installed for
the peer; a fork in a ``--target`` directory of its own is found by its version. The routes done
for real, with pip and a copy of verl: test_fork_routes_real.py."""

from __future__ import annotations

import importlib
import importlib.machinery
import sys
from pathlib import Path

import pytest

from rlaudit.errors import InputError
from rlaudit.targets.peers import registry


def _package(root, name: str, text: str = "") -> None:
    (root / name).mkdir(parents=True)
    (root / name / "__init__.py").write_text(text)


@pytest.fixture
def clean(monkeypatch, tmp_path):
    # no verl already importable from the path (a worker that ran a real peer's tests has the
    # installed peers directory on it): the stand-ins are the only verls here
    monkeypatch.setattr(sys, "path", [p for p in sys.path if not (Path(p) / "verl").exists()])
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    monkeypatch.setenv("RLAUDIT_PEERS_DIR", str(tmp_path / "peers"))
    for mod in ("verl", "fake_dep_of_verl"):
        monkeypatch.delitem(sys.modules, mod, raising=False)
    yield tmp_path
    for mod in ("verl", "fake_dep_of_verl"):
        sys.modules.pop(mod, None)


def test_an_editable_fork_wins_and_finds_its_dependencies(clean):
    fork = clean / "fork"
    _package(fork, "verl", "WHO = 'fork'\nimport fake_dep_of_verl\n")
    pinned = clean / "peers" / "verl-0.9.1"
    _package(pinned, "verl", "WHO = 'pinned'\n")
    _package(pinned, "fake_dep_of_verl")
    sys.path.insert(0, str(fork))                 # what `pip install -e` makes importable
    importlib.invalidate_caches()
    assert registry.activate("verl") is None      # the environment's verl is used ...
    assert importlib.import_module("verl").WHO == "fork"   # ... and imports its dependency
    assert sys.path[-1] == str(pinned)            # from behind everything the environment has


class _EditableFinder:
    """What setuptools' editable install adds: a finder for one package, asked after sys.path."""

    def __init__(self, root):
        self.root = root

    def find_spec(self, fullname, path=None, target=None):
        if fullname != "verl":
            return None
        return importlib.machinery.PathFinder.find_spec(fullname, [str(self.root)])


def test_an_editable_fork_found_by_a_finder_wins_over_the_appended_peer(clean):
    fork = clean / "fork"
    _package(fork, "verl", "WHO = 'fork'\nimport fake_dep_of_verl\n")
    pinned = clean / "peers" / "verl-0.9.1"
    _package(pinned, "verl", "WHO = 'pinned'\n")
    _package(pinned, "fake_dep_of_verl")
    sys.meta_path.append(_EditableFinder(fork))
    importlib.invalidate_caches()
    assert registry.activate("verl") is None
    assert importlib.import_module("verl").WHO == "fork"
    assert sys.path[-1] == str(pinned)


def test_a_fork_in_its_own_target_directory_is_found_by_version(clean):
    _package(clean / "peers" / "verl-0.9.1+mine", "verl", "WHO = 'mine'\n")
    assert registry.activate("verl", "0.9.1+mine") == "0.9.1+mine"
    assert importlib.import_module("verl").WHO == "mine"
    with pytest.raises(InputError, match=r"installed: 0.9.1\+mine"):
        registry.activate("verl", "0.9.2")
