"""The list of checks an ``rlaudit run --json`` output contains, to prove two runs checked the same
things (e.g. before and after a speed change): one tab-separated line per
(scenario, backend, invariant, variant) with the check's status, plus one per golden comparison
(scenario, backend, "golden", step:metric).

    rlaudit run --all --json > after.json
    python benchmarks/check_list.py after.json > after.tsv          # rlaudit importable
    python benchmarks/check_list.py --diff before.tsv after.tsv     # exit 1 if they differ
    python benchmarks/check_list.py --metrics before.json after.json  # metrics bit for bit

The variants of an invariant are the runs it asks for (``Invariant.variants``, computed here from
the scenario files with the rlaudit on the path, so run it from the checkout that produced the
JSON: ``suite_time.py --keep`` does); "base" is always among them. Statuses are part of the line,
so a check that passed before and is n/a after shows up as a difference.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def _variants(path: str, invariants: list[str]) -> dict[str, list[str]]:
    from rlaudit.data.io import load_rollout
    from rlaudit.scenarios.invariants import INVARIANTS
    from rlaudit.scenarios.spec import load_scenario
    from rlaudit.update.step import select_groups

    scn = load_scenario(Path(path))
    batch, _ = select_groups(load_rollout(scn.rollout), scn.config)
    out = {}
    for name in invariants:
        names = [v.name for v in INVARIANTS.get(name).variants(scn, batch)]
        out[name] = sorted({"base", *names})
    return out


def check_lines(results: list[dict]) -> list[str]:
    lines = []
    for res in results:
        invariants = sorted({c["invariant"] for c in res["checks"] if c["invariant"] != "*"})
        variants = _variants(res["path"], invariants)
        for c in res["checks"]:
            for v in variants.get(c["invariant"], ["*"]):
                lines.append("\t".join([res["scenario"], c["backend"], c["invariant"], v,
                                        c["status"]]))
        for g in res["golden"]:
            rows = g.get("rows") or [{"step": "*", "metric": "*"}]
            for row in rows:
                lines.append("\t".join([res["scenario"], g["backend"], "golden",
                                        f"{row.get('step')}:{row.get('metric')}", g["status"]]))
    return sorted(lines)


def metric_diffs(a: list[dict], b: list[dict]) -> list[str]:
    """Scenario/backend/step/metric entries whose values differ at all (timings excluded)."""
    def table(results):
        out = {}
        for res in results:
            for backend, steps in res["metrics"].items():
                for i, step in enumerate(steps):
                    for k, v in step.items():
                        if not k.startswith("timing/"):
                            out[(res["scenario"], backend, i, k)] = v
        return out

    ta, tb = table(a), table(b)
    diffs = [f"only in first: {k}" for k in sorted(ta.keys() - tb.keys(), key=str)]
    diffs += [f"only in second: {k}" for k in sorted(tb.keys() - ta.keys(), key=str)]
    diffs += [f"{k}: {ta[k]!r} != {tb[k]!r}" for k in sorted(ta.keys() & tb.keys(), key=str)
              if ta[k] != tb[k] and not (ta[k] != ta[k] and tb[k] != tb[k])]  # NaN == NaN here
    return diffs


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("files", nargs="+", type=Path)
    g = p.add_mutually_exclusive_group()
    g.add_argument("--diff", action="store_true", help="compare two check lists (.tsv)")
    g.add_argument("--metrics", action="store_true", help="compare two --json outputs' metrics")
    a = p.parse_args(argv)
    if a.diff or a.metrics:
        if len(a.files) != 2:
            p.error("--diff/--metrics take two files")
        if a.diff:
            first, second = (set(f.read_text().splitlines()) for f in a.files)
            diffs = [f"- {x}" for x in sorted(first - second)]
            diffs += [f"+ {x}" for x in sorted(second - first)]
            count = len(first)
        else:
            first, second = (json.loads(f.read_text()) for f in a.files)
            diffs = metric_diffs(first, second)
            count = sum(len(s) for r in first for s in r["metrics"].values())
        print("\n".join(diffs) if diffs else f"identical ({count} entries)")
        return 1 if diffs else 0
    for f in a.files:
        print("\n".join(check_lines(json.loads(f.read_text()))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
