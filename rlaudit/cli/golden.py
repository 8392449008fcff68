"""``rlaudit golden``: explicit golden regeneration and tolerance calibration.

    rlaudit golden bless SCENARIO... | --all [--backend B]   regenerate (still exits 1: review);
                                                             refused where the run's own checks fail
    rlaudit golden calibrate SCENARIO --runs N [--write]      propose tolerances from the spread
    rlaudit golden orphans                                    goldens no scenario has any more
                                                             (exit 1 if any)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from rlaudit.cli.argcheck import check_run_options
from rlaudit.cli.common import add_location_args, resolve_scenarios
from rlaudit.errors import EXIT_BAD_INPUT, EXIT_CHECK_FAILED


def add_parser(sub) -> None:
    p = sub.add_parser("golden", help="bless or calibrate golden metrics")
    gsub = p.add_subparsers(dest="golden_command", metavar="ACTION", required=True,
                            parser_class=type(p))
    b = gsub.add_parser("bless", help="regenerate golden files from a fresh run")
    b.add_argument("scenarios", nargs="*")
    b.add_argument("--all", action="store_true")
    b.add_argument("--backend", action="append", dest="backends", metavar="NAME")
    b.add_argument("--force", action="store_true",
                   help="bless even when an invariant failed or a backend crashed in this run "
                        "(refused otherwise: nothing is written)")
    add_location_args(b)
    b.set_defaults(func=bless)
    c = gsub.add_parser("calibrate", help="repeat a scenario and propose per-metric tolerances")
    c.add_argument("scenario")
    c.add_argument("--runs", type=int, default=5)
    c.add_argument("--backend", action="append", dest="backends", metavar="NAME")
    c.add_argument("--write", action="store_true",
                   help="store the proposed tolerances in the golden file")
    add_location_args(c)
    c.set_defaults(func=calibrate)
    o = gsub.add_parser("orphans", help="list golden files whose scenario is gone (exit 1 if any)")
    add_location_args(o)
    o.set_defaults(func=orphans)


def bless(args) -> int:
    # lazy: report and MLflow modules: kept out of CLI start-up
    from rlaudit.report.console import render_result
    # lazy: the launcher: only commands that start ranks
    from rlaudit.backends.launch.pool import warm_pools
    # lazy: torch and the engine: kept out of CLI start-up
    from rlaudit.scenarios.outcome import exit_code, run_isolated
    from rlaudit.verdict.result import BLESSED, REFUSED  # lazy: as above
    from rlaudit.scenarios.validate import validate_invocation  # lazy: as above
    check_run_options(args)
    paths = resolve_scenarios(args.scenarios, all_=args.all, scenarios_dir=args.scenarios_dir)
    scenarios = validate_invocation(paths, backends=args.backends, golden_dir=args.golden_dir)
    results = []
    with warm_pools():  # one spawn per multi-rank layout for all the scenarios
        for scn in scenarios:
            res = run_isolated(scn, backends=args.backends, golden_dir=args.golden_dir,
                               bless=True, force=args.force)
            results.append(res)
            print(render_result(res), flush=True)
    blessed = [r.scenario for r in results if any(g.status == BLESSED for g in r.golden)]
    refused = [r.scenario for r in results if any(g.status == REFUSED for g in r.golden)]
    if blessed:
        print(f"goldens regenerated for {len(blessed)} scenario(s): review `git diff "
              f"{args.golden_dir}/` before committing; this run exits 1 so that a bless never "
              "passes CI by accident", file=sys.stderr)
    if refused:
        print(f"rlaudit: bless refused for {', '.join(refused)} (nothing written): its own "
              "checks failed in this run; fix them, or pass --force", file=sys.stderr)
    return max(exit_code(results), EXIT_CHECK_FAILED)


def calibrate(args) -> int:
    # lazy: report and MLflow modules: kept out of CLI start-up
    from rlaudit.report.calibrate import apply_tolerances, calibrate_scenario
    # lazy: torch and the engine: kept out of CLI start-up
    from rlaudit.scenarios.golden import golden_path, write_json_atomic
    # lazy: yaml and the scenario schema: kept out of CLI start-up
    from rlaudit.scenarios.validate import validate_invocation
    check_run_options(args)
    (path,) = resolve_scenarios([args.scenario], all_=False, scenarios_dir=args.scenarios_dir)
    # every input (rollout values, the golden --write would edit), before the first of the runs
    (scn,) = validate_invocation([path], backends=args.backends, golden_dir=args.golden_dir)
    # lazy: the launcher: only commands that start ranks
    from rlaudit.backends.launch.pool import warm_pools
    with warm_pools():  # the runs reuse the ranks, each restored to a fresh rank's state
        proposed = calibrate_scenario(scn, runs=args.runs, backends=args.backends)
    print(json.dumps(proposed, indent=1, sort_keys=True))
    if args.write:
        gp = golden_path(Path(args.golden_dir), scn)
        if not gp.exists():
            print(f"rlaudit: no golden {gp} to write tolerances into; bless it first",
                  file=sys.stderr)
            return EXIT_BAD_INPUT
        write_json_atomic(gp, apply_tolerances(json.loads(gp.read_text()), proposed))
        print(f"wrote tolerances into {gp}", file=sys.stderr)
    return 0


def orphan_lines(golden_dir: str, scenarios_dir: str) -> list[str]:
    """One line per golden under ``golden_dir`` whose scenario is not under ``scenarios_dir``."""
    from rlaudit.scenarios.golden import orphan_goldens  # lazy: imports torch
    return [f"orphan golden {p.stem} ({p}): no scenario named {p.stem!r} under {scenarios_dir}"
            for p in orphan_goldens(Path(golden_dir), Path(scenarios_dir))]


def orphan_warning(golden_dir: str, scenarios_dir: str) -> str | None:
    """One line for ``rlaudit run --all``'s stderr when some golden has no scenario, else None."""
    from rlaudit.scenarios.golden import orphan_goldens  # lazy: imports torch
    names = [p.stem for p in orphan_goldens(Path(golden_dir), Path(scenarios_dir))]
    if not names:
        return None
    shown = ", ".join(names[:5]) + (", ..." if len(names) > 5 else "")
    return (f"rlaudit: warning: {len(names)} golden file(s) under {golden_dir} have no scenario "
            f"under {scenarios_dir} ({shown}): see `rlaudit golden orphans`")


def orphans(args) -> int:
    """A golden nothing compares any more (its scenario renamed or deleted) is dead weight that
    still looks like coverage: name each one, exit 1 if any."""
    lines = orphan_lines(args.golden_dir, args.scenarios_dir)
    for line in lines:
        print(line)
    if lines:
        print(f"rlaudit: {len(lines)} orphan golden(s): delete each (git rm), or restore or "
              "rename its scenario (docs/scenarios.md)", file=sys.stderr)
        return EXIT_CHECK_FAILED
    print(f"no orphan goldens under {args.golden_dir}", file=sys.stderr)
    return 0
