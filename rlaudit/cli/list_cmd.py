"""``rlaudit list``: scenarios, backends, invariants (and the algorithm registries)."""

from __future__ import annotations

import json

from rlaudit.cli.common import add_location_args
from rlaudit.metrics import CATALOGUE


def add_parser(sub) -> None:
    p = sub.add_parser("list", help="list scenarios, backends, invariants and algorithm names")
    p.add_argument("what", nargs="?", default="all",
                   choices=["all", "scenarios", "backends", "invariants", "algorithms", "metrics"])
    p.add_argument("--json", action="store_true")
    add_location_args(p, golden=False)
    p.set_defaults(func=run)


def collect(what: str, scenarios_dir: str) -> dict:
    out: dict = {}
    if what in ("all", "scenarios"):
        # lazy: yaml and the scenario schema: kept out of CLI start-up
        from rlaudit.scenarios.spec import discover, load_scenario
        rows = []
        for path in discover(scenarios_dir):
            scn = load_scenario(path)
            rows.append({"name": scn.name, "backends": scn.backends, "invariants": scn.invariants,
                         "steps": scn.steps, "dtype": scn.dtype, "tags": scn.tags,
                         "description": scn.description})
        out["scenarios"] = rows
    # from rlaudit.catalogue: cached per source version, so listing imports neither torch nor
    # megatron (the first call after a change computes and caches them)
    from rlaudit import catalogue  # lazy: only `list` reads the catalogue
    if what in ("all", "backends"):
        out["backends"] = catalogue.backends()
    if what in ("all", "invariants"):
        out["invariants"] = catalogue.invariant_docs()
    if what in ("all", "algorithms"):
        out["algorithms"] = catalogue.algorithms()
    if what == "metrics":
        out["metrics"] = [{"name": s.name, "reduction": s.reduction, "doc": s.doc}
                          for s in CATALOGUE.values()]
    return out


def run(args) -> int:
    data = collect(args.what, args.scenarios_dir)
    if args.json:
        print(json.dumps(data, indent=1))
        return 0
    for s in data.get("scenarios", []):
        backends = ", ".join(f"{b}{layout or ''}" for b, layout in s["backends"].items())
        print(f"scenario  {s['name']:36s} [{backends}] {s['description'][:70]}")
    for b in data.get("backends", []):
        print(f"backend   {b['name']:36s} {'available' if b['available'] else 'unavailable: ' + b['why']}")
    for i in data.get("invariants", []):
        first = i["doc"].split(". ")[0].replace("\n", " ")
        print(f"invariant {i['name']:36s} ({i['family']}) {first[:80]}")
    for kind, names in data.get("algorithms", {}).items():
        print(f"{kind}: {', '.join(names)}")
    for m in data.get("metrics", []):
        print(f"metric    {m['name']:36s} ({m['reduction']}) {m['doc'][:70]}")
    return 0
