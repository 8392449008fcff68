"""Helpers shared by subcommands: locating scenarios, resolving names to files."""

from __future__ import annotations

from pathlib import Path

from rlaudit import switches


DEFAULT_SCENARIOS = "scenarios"
DEFAULT_GOLDEN = "golden"
DEFAULT_REPORTS = "reports"


def add_location_args(p, *, golden: bool = True) -> None:
    p.add_argument("--scenarios-dir", default=switches.scenarios_dir(DEFAULT_SCENARIOS),
                   help="where scenario files live (env RLAUDIT_SCENARIOS; default: %(default)s)")
    if golden:
        p.add_argument("--golden-dir", default=switches.golden_dir(DEFAULT_GOLDEN),
                       help="golden files (env RLAUDIT_GOLDEN; default: %(default)s)")


def resolve_scenarios(names: list[str], *, all_: bool, scenarios_dir: str) -> list[Path]:
    """Scenario names (file stems), paths, or --all -> scenario files."""
    # lazy: yaml and the scenario schema: kept out of CLI start-up
    from rlaudit.scenarios.spec import resolve
    return resolve(names, all_=all_, root=scenarios_dir)
