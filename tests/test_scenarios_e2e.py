"""Every committed scenario end to end against its committed golden.

On the reference backend: all scenarios, every invariant and the golden comparison (so a change
to the code that moves a metric, or a golden nobody re-blessed, fails CI). On the multi-rank
backends: the four seed scenarios (one spawned group each), compared with the reference and
with their own goldens. The full backend sweep is `rlaudit run --all` (the README's main command).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from rlaudit.report.console import render_result
from rlaudit.scenarios.engine import run_scenario
from rlaudit.scenarios.spec import discover, load_scenario

ROOT = Path(__file__).resolve().parents[1]
SCENARIOS = discover(ROOT / "scenarios")
GOLDEN = ROOT / "golden"
SEEDS = [p for p in SCENARIOS if p.stem.startswith("seed_")]

pytestmark = pytest.mark.slow


def _check(path: Path, backends: list[str]) -> None:
    scn = load_scenario(path)
    res = run_scenario(scn, backends=backends, golden_dir=GOLDEN)
    statuses = {g.backend: g.status for g in res.golden}
    assert all(statuses.get(b) == "pass" for b in backends), (statuses, render_result(res))
    assert res.passed, render_result(res)


@pytest.mark.parametrize("path", SCENARIOS, ids=[p.stem for p in SCENARIOS])
def test_reference(path, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _check(path, ["reference"])


@pytest.mark.parametrize("backend", ["fsdp", "megatron"])
@pytest.mark.parametrize("path", SEEDS, ids=[p.stem for p in SEEDS])
def test_seed_scenarios_on_multi_rank_backends(path, backend):
    if backend not in load_scenario(path).backends:
        pytest.skip(f"{path.stem} does not configure {backend}")
    if backend == "megatron":
        pytest.importorskip("megatron.core")
    _check(path, ["reference", backend])


def test_there_are_at_least_fifteen_scenarios():
    assert len(SCENARIOS) >= 15
    assert len(SEEDS) == 4
