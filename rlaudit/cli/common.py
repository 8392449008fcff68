"""Helpers shared by subcommands: locating scenarios, resolving names to files."""

from __future__ import annotations

import os
from pathlib import Path

from rlaudit.errors import InputError

DEFAULT_SCENARIOS = "scenarios"
DEFAULT_GOLDEN = "golden"
DEFAULT_REPORTS = "reports"


def env_default(name: str, fallback: str) -> str:
    return os.environ.get(name, fallback)


def add_location_args(p, *, golden: bool = True) -> None:
    p.add_argument("--scenarios-dir", default=env_default("RLAUDIT_SCENARIOS", DEFAULT_SCENARIOS),
                   help="where scenario files live (env RLAUDIT_SCENARIOS; default: %(default)s)")
    if golden:
        p.add_argument("--golden-dir", default=env_default("RLAUDIT_GOLDEN", DEFAULT_GOLDEN),
                       help="golden files (env RLAUDIT_GOLDEN; default: %(default)s)")


def resolve_scenarios(names: list[str], *, all_: bool, scenarios_dir: str) -> list[Path]:
    """Scenario names (file stems), paths, or --all -> scenario files."""
    from rlaudit.scenarios.spec import discover
    root = Path(scenarios_dir)
    if all_:
        if names:
            raise InputError("give scenario names or --all, not both")
        found = discover(root)
        if not found:
            raise InputError(f"no scenario files under {root}", source=str(root))
        return found
    if not names:
        raise InputError("name at least one scenario (see `rlaudit list`) or pass --all")
    out = []
    by_stem = {p.stem: p for p in discover(root)} if root.exists() else {}
    for n in names:
        p = Path(n)
        if p.suffix in (".yaml", ".yml") and p.exists():
            out.append(p)
        elif n in by_stem:
            out.append(by_stem[n])
        else:
            raise InputError(f"no scenario named {n!r} under {root} (known: "
                             f"{', '.join(sorted(by_stem)) or 'none'})", key=n)
    return out
