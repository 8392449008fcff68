"""pytest plugin (registered through the ``pytest11`` entry point): scenarios as test items.

    pytest scenarios/                          every scenario file, one item per scenario x backend
    pytest scenarios/ -n auto                  in parallel (pytest-xdist)
    pytest scenarios/seed_entropy_coeff_zero.yaml --rlaudit-backend fsdp
    pytest scenarios/ --rlaudit-bless          regenerate goldens (items fail: review the diff;
                                               refused for an item whose own checks fail)

A YAML file is collected when it has a top-level ``invariants`` key (a scenario); item ids read
``scenarios/<file>.yaml::<scenario>[<backend>]``. An item runs the scenario on its backend (plus
the reference backend, which parity checks compare against) and fails with the invariant table.

Multi-rank replays in a session (scenario items and any test calling a backend) reuse warm rank
pools, one set per xdist worker (``--rlaudit-fresh-ranks`` spawns per replay instead).

Kept import-light: nothing heavy is imported until a scenario file is collected.
"""

from __future__ import annotations

from pathlib import Path

import pytest


def pytest_addoption(parser):
    group = parser.getgroup("rlaudit", "rlaudit scenarios")
    group.addoption("--rlaudit-backend", action="append", default=None, metavar="NAME",
                    help="only items for this backend (repeatable)")
    group.addoption("--rlaudit-golden-dir", default="golden", metavar="DIR",
                    help="golden files directory, relative to the rootdir (default: %(default)s)")
    group.addoption("--rlaudit-bless", action="store_true",
                    help="regenerate golden files from this run (items still fail)")
    group.addoption("--rlaudit-require-golden", action="store_true",
                    help="an item without a golden to compare against fails (default: it passes "
                         "on its invariants)")
    group.addoption("--rlaudit-fresh-ranks", action="store_true",
                    help="spawn a process group for every multi-rank replay instead of reusing "
                         "the session's warm rank pools")


def pytest_configure(config):
    config.addinivalue_line("markers", "rlaudit_scenario: an rlaudit scenario item")


def pytest_sessionstart(session):
    """Warm rank pools for the session (one set per xdist worker): multi-rank replays reuse a
    group per backend and world size instead of spawning one each (the pools are created on
    first use, so a session without multi-rank replays spawns nothing)."""
    if session.config.getoption("rlaudit_fresh_ranks"):
        return
    from rlaudit.backends.launch.pool import warm_pools

    block = warm_pools()
    block.__enter__()
    session.config.stash[_POOLS] = block


def pytest_sessionfinish(session, exitstatus):
    block = session.config.stash.get(_POOLS, None)
    if block is not None:
        del session.config.stash[_POOLS]
        block.__exit__(None, None, None)


_POOLS = pytest.StashKey()


def _is_scenario(path: Path, root: Path | None = None) -> bool:
    """``root``: the rootdir; only models/, rollouts/ and found/ *below* it are data directories (a
    checkout that lives under some ``.../models/...`` keeps its scenarios)."""
    parts = path.parts
    if root is not None and path.is_relative_to(root):
        parts = path.relative_to(root).parts
    if path.suffix not in (".yaml", ".yml") or {"models", "rollouts", "found"} & set(parts[:-1]):
        return False
    try:
        import yaml
        data = yaml.safe_load(path.read_text())
    except Exception:
        return False
    return isinstance(data, dict) and "invariants" in data


def pytest_collect_file(file_path: Path, parent):
    if _is_scenario(Path(file_path), Path(parent.config.rootpath)):
        return ScenarioFile.from_parent(parent, path=file_path)
    return None


class ScenarioFile(pytest.File):
    def collect(self):
        from rlaudit.scenarios.spec import load_scenario
        scn = load_scenario(self.path)
        wanted = self.config.getoption("rlaudit_backend")
        for backend in scn.backends:
            if wanted and backend not in wanted:
                continue
            yield ScenarioItem.from_parent(self, name=f"{scn.name}[{backend}]", scenario=scn,
                                           backend=backend)


class ScenarioFailed(Exception):
    pass


class ScenarioItem(pytest.Item):
    def __init__(self, *, scenario, backend, **kw):
        super().__init__(**kw)
        self.scenario = scenario
        self.backend = backend
        self.add_marker(pytest.mark.rlaudit_scenario)

    def runtest(self):
        from rlaudit.backends.registry import get_backend
        from rlaudit.report.console import render_result
        from rlaudit.scenarios.engine import run_scenario
        ok, why = get_backend(self.backend).available()
        if not ok:
            pytest.skip(f"backend {self.backend} unavailable: {why}")
        from rlaudit.scenarios.golden import bless_blocker, compare_or_bless
        backends = ["reference"] if self.backend == "reference" else ["reference", self.backend]
        res = run_scenario(self.scenario, backends=backends, golden_dir=None)
        # the reference backend's own item reports its checks; this item reports its backend's
        res.checks = [c for c in res.checks if c.backend in (self.backend, "*")
                      or (self.backend == "reference")]
        if self.backend in res.runs:  # goldens of this item's backend only: no xdist races
            golden_dir = Path(self.config.getoption("rlaudit_golden_dir"))
            if not golden_dir.is_absolute():
                golden_dir = Path(self.config.rootpath) / golden_dir
            bless = self.config.getoption("rlaudit_bless")  # refused if this item's checks fail
            res.golden = compare_or_bless(self.scenario, {self.backend: res.runs[self.backend]},
                                          golden_dir, bless=bless,
                                          refuse=bless_blocker(res) if bless else None)
        from rlaudit.scenarios.result import NO_GOLDEN_STATE, PASSED
        allowed = {PASSED} | (set() if self.config.getoption("rlaudit_require_golden")
                              else {NO_GOLDEN_STATE})
        if res.state not in allowed:
            raise ScenarioFailed(render_result(res))

    def repr_failure(self, excinfo, style=None):
        if isinstance(excinfo.value, ScenarioFailed):
            return str(excinfo.value)
        return super().repr_failure(excinfo, style=style)

    def reportinfo(self):
        return self.path, 0, f"scenario {self.name}"
