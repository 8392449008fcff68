"""``rlaudit run``: replay scenarios on their backends, check invariants and goldens, log to MLflow.

    rlaudit run seed_entropy_coeff_zero --backend fsdp
    rlaudit run --all --json
    rlaudit run --target mypkg.audit:Adapter
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TextIO

from rlaudit import switches
from rlaudit.cli.argcheck import check_run_options
from rlaudit.cli.common import DEFAULT_REPORTS, add_location_args, resolve_scenarios
from rlaudit.cli.golden import orphan_warning
from rlaudit.cli.result_stream import result_stream
from rlaudit.errors import EXIT_INTERRUPTED
from rlaudit.heap import importing
from rlaudit.quiet import third_party_to_log


def add_parser(sub) -> None:
    p = sub.add_parser("run", help="replay scenarios, check invariants and goldens")
    p.add_argument("scenarios", nargs="*", help="scenario names or files")
    p.add_argument("--all", action="store_true", help="every scenario under --scenarios-dir")
    p.add_argument("--backend", action="append", dest="backends", metavar="NAME",
                   help="check only this backend (repeatable; the reference backend always runs "
                        "as the parity oracle; default: each scenario's backends)")
    p.add_argument("--target", metavar="MODULE:ADAPTER",
                   help="audit your own trainer through an adapter (see docs/targets.md)")
    p.add_argument("--json", action="store_true", help="print results as JSON on stdout")
    p.add_argument("--bless", action="store_true", help=argparse_bless_help())
    p.add_argument("--force", action="store_true",
                   help="with --bless: bless even when an invariant failed or a backend crashed "
                        "in this run (refused otherwise, nothing written)")
    p.add_argument("--require-golden", action="store_true",
                   help="a scenario x backend without a golden to compare against fails the run "
                        "(the nightly job's setting; default: reported as 'no golden', exit 0)")
    add_location_args(p)
    p.add_argument("--report-dir", default=switches.reports_dir(DEFAULT_REPORTS),
                   help="where the run report and the embedded MLflow store go "
                        "(default: %(default)s)")
    p.add_argument("--tracking-uri", default=None,
                   help="MLflow tracking URI (default: $MLFLOW_TRACKING_URI, else a sqlite store "
                        "under --report-dir)")
    p.add_argument("--no-mlflow", action="store_true", help="do not log to MLflow")
    p.add_argument("--device", choices=["cpu", "cuda"], default=None,
                   help="override every scenario's device (nightly GPU job: cuda)")
    p.add_argument("--timeout", type=float, default=900.0,
                   help="seconds each scenario may take, wherever its replays run (this "
                        "process, rank groups, Ray); one past it fails, naming the limit "
                        "(default: %(default)s)")
    p.add_argument("--executor", choices=["local", "ray"], default="local",
                   help="where the scenario x backend jobs run: this machine with warm rank "
                        "pools, or Ray (placement group per multi-rank job; default: %(default)s)")
    p.add_argument("--ray-address", default=None, metavar="ADDRESS",
                   help="join this Ray cluster (--executor ray; default: start a local one)")
    p.add_argument("--jobs", type=int, default=2, metavar="N",
                   help="scenarios in flight with the local executor (default: %(default)s: one "
                        "scenario's one-core work overlaps another's multi-rank replay)")
    p.set_defaults(func=run)


def _with_oracle(backends: list[str] | None) -> list[str] | None:
    """--backend fsdp means "check fsdp": the reference backend runs too, as the parity oracle."""
    if backends is None:
        return None
    return list(dict.fromkeys(["reference", *backends]))


def argparse_bless_help() -> str:
    return "regenerate the goldens from this run (the run still exits 1: review the diff)"


def run(args) -> int:
    # lazy: the launcher: only commands that start ranks
    from rlaudit.backends.launch.pool import warm_pools

    check_run_options(args)  # a --report-dir that is a file, a NaN --timeout: exit 2 now
    # third-party warnings to <report dir>/rlaudit.log; ranks spawned once per invocation
    log = Path(args.report_dir) / "rlaudit.log"
    try:
        # --json: whatever the code under audit prints goes to stderr, the JSON alone to stdout
        with third_party_to_log(log), warm_pools(), result_stream(args.json) as out:
            return _run(args, out)
    finally:
        # lazy: the launcher: only commands that start ranks
        from rlaudit.backends.launch import start
        # no import left running after exit; kept while ranks forked from it run (called
        # in-process by a test session that has pools up, say)
        start.stop_forkserver()
        if log.is_file() and log.stat().st_size:
            print(f"third-party warnings and logs: {log}", file=sys.stderr)


def _run(args, out: TextIO) -> int:
    plots: dict = {}  # the report's plots, rendered as scenario results come in (_plots_now)
    if args.target:
        results = _run_target(args)
    else:
        # lazy: torch and the engine: kept out of CLI start-up
        from rlaudit.scenarios.outcome import run_isolated
        from rlaudit.scenarios.validate import validate_invocation  # lazy: as above
        paths = resolve_scenarios(args.scenarios, all_=args.all, scenarios_dir=args.scenarios_dir)
        _start_rank_imports(args, paths)
        # every input of every scenario, before any runs: exit 2 with all problems, or go
        with importing():  # it imports torch and the engine: no full collections on the way
            scenarios = validate_invocation(paths, backends=args.backends,
                                            golden_dir=args.golden_dir, device=args.device)
        orphans = orphan_warning(args.golden_dir, args.scenarios_dir) if args.all else None
        if orphans:  # a golden whose scenario was renamed or deleted compares nothing
            print(orphans, file=sys.stderr)
        # lazy: torch and the engine: kept out of CLI start-up
        from rlaudit.executors import make_executor
        results = []
        backends = _with_oracle(args.backends)
        done = {}  # scenario name -> result, as each finishes (map yields them in order)

        def run_one(scn, replay):
            # a late failure is this scenario's result: the others run, all are reported
            done[scn.name] = run_isolated(scn, backends=backends, golden_dir=args.golden_dir,
                                          bless=args.bless, force=args.force,
                                          timeout=args.timeout, replay=replay,
                                          concurrent_backends=executor.concurrent_backends)
            return done[scn.name]

        try:
            with make_executor(args.executor, scenarios, backends=backends,
                               progress=not args.json or sys.stderr.isatty(),
                               ray_address=args.ray_address, jobs=args.jobs,
                               timeout=args.timeout,
                               when_idle=lambda: _warm_report_imports(args)) as executor:
                for scn, res in executor.map(scenarios, run_one):
                    results.append(res)
                    if not args.json:
                        # lazy: report and MLflow modules: kept out of CLI start-up
                        from rlaudit.report.console import render_result
                        with executor.progress.paused():
                            print(render_result(res), flush=True)
                            print(flush=True)
                    _plots_now(res, plots)
        except KeyboardInterrupt:  # the executor stopped its replays on the way out
            shown = len(results)
            results += [done[s.name] for s in scenarios[shown:] if s.name in done]
            print(f"rlaudit: interrupted after {len(results)} of {len(scenarios)} scenario(s); "
                  "reporting those", file=sys.stderr, flush=True)
            finished = {r.scenario for r in results}
            stopped = [interrupted_result(s, backends) for s in scenarios
                       if s.name not in finished]
            # what finished is still reported and logged; the rest is "interrupted", never
            # passed (MLflow: the invocation KILLED)
            _report(results, args, plots, interrupted=[r.scenario for r in stopped],
                    shown=results + stopped)
            _print_results(results + stopped, args, out, rendered=shown)
            return EXIT_INTERRUPTED
    _report(results, args, plots)
    _print_results(results, args, out, rendered=len(results))
    # lazy: torch and the engine: kept out of CLI start-up
    from rlaudit.scenarios.outcome import exit_code
    return exit_code(results, require_golden=args.require_golden)


def _run_target(args) -> list:
    """``run --target``: the target's stage checks and scenarios, each table printed as it
    comes (unless --json)."""
    from rlaudit.targets.run.runner import run_target  # lazy: torch, engine, backends
    from rlaudit.targets.run.validate import validate_target  # lazy: as run_target
    paths = (resolve_scenarios(args.scenarios, all_=args.all, scenarios_dir=args.scenarios_dir)
             if args.scenarios or args.all else [])
    adapter = validate_target(args.target, paths)  # stage signatures, scenario inputs
    import torch  # lazy: torch: kept out of CLI start-up (`rlaudit list`, `--help`)

    torch.set_num_threads(switches.threads())        # as for scenarios (RLAUDIT_THREADS)
    results = run_target(adapter, scenario_names=args.scenarios, all_=args.all,
                         scenarios_dir=args.scenarios_dir)
    if not args.json:
        # lazy: report and MLflow modules: kept out of CLI start-up
        from rlaudit.report.console import render_result
        for res in results:
            print(render_result(res), flush=True)
            print(flush=True)
    note = target_scope_note(args.scenarios, args.all)
    if note:
        print(note, file=sys.stderr)
    return results


def interrupted_result(scn, backends: list[str] | None):
    """The result of a scenario a Ctrl-C stopped: state "interrupted", nothing else known."""
    from rlaudit.verdict.result import ScenarioResult  # lazy: with the engine, after validation

    names = [b for b in (backends or list(scn.backends)) if b in scn.backends or b == "reference"]
    return ScenarioResult(scenario=scn.name, path=str(scn.path), backends=names,
                          layouts={b: dict(scn.backends.get(b, {})) for b in names},
                          dtype=scn.dtype, device=scn.device, tags=list(scn.tags),
                          interrupted=True)


def _print_results(results, args, out: TextIO, *, rendered: int) -> None:
    """The JSON of ``results`` (``--json``), or the tables of those past the first
    ``rendered`` (printed as they came) and the summary; the JSON goes to ``out`` (the real
    stdout, while whatever the code under audit prints goes to stderr)."""
    if args.json:
        json.dump([r.to_json() for r in results], out, indent=1, default=str)
        print(file=out)
        return
    # lazy: report and MLflow modules: kept out of CLI start-up
    from rlaudit.report.console import render_result, render_summary
    for res in results[rendered:]:
        print(render_result(res), flush=True)
        print(flush=True)
    print(render_summary(results))


def target_scope_note(scenarios: list[str] | None, all_: bool) -> str | None:
    """What a ``--target`` run left out, for stderr (stdout may be JSON): without names, every
    shipped scenario; with names, the built-in scenario (a trainer averaging its entropy over
    tool-output holes passes every named scenario that lacks either ragged responses or holes,
    and fails the built-in one, which has both). None with ``--all``, which runs everything."""
    if all_:
        return None
    if not scenarios:
        return ("rlaudit: the stage checks and the built-in scenario only; `--all` replays "
                "every shipped scenario on the target too (optimizer state over steps, stale "
                "rollouts, DAPO, distillation, ...): what a release audit runs")
    return ("rlaudit: the stage checks and the named scenarios only: the built-in scenario "
            "(every invariant that applies, on rlaudit's own rollout) runs when no scenario is "
            "named, or with `--all`, which adds every shipped scenario")


def _start_rank_imports(args, paths) -> None:
    """Start the forkserver that CPU warm pools fork their ranks from now, so that its imports
    (torch, transformers, megatron-core: seconds) overlap this process's own loading and
    validation (rlaudit/backends/launch/start.py) -- when some scenario will replay on a
    multi-rank backend on CPU: not with --executor ray or --device cuda, nor for scenarios
    that only name the reference backend (a glance at their files' ``backends`` and ``device``;
    validation proper comes next, and whatever it finds, nothing is lost but this head start)."""
    if args.executor != "local" or args.device == "cuda":
        return
    if not any(_forks_ranks(path, args.backends, args.device) for path in paths):
        return
    from rlaudit.backends.launch import start  # lazy: the launcher: only commands that start ranks

    if start.start_method("cpu") == "forkserver":
        start.ensure_forkserver()


def _forks_ranks(path, backends: list[str] | None, device: str | None) -> bool:
    import yaml  # lazy: yaml: kept out of CLI start-up

    try:
        spec = yaml.safe_load(Path(path).read_text())
        named = set(spec.get("backends") or {})
        on_cpu = (device or spec.get("device") or "cpu") == "cpu"
    except Exception:  # noqa: BLE001 - validation reports it
        return False
    if backends is not None:
        named &= set(backends)
    return on_cpu and bool(named - {"reference"})


def _warm_report_imports(args) -> None:
    """The report's and MLflow's imports, in the background while ranks work (report/warm.py)."""
    # lazy: report and MLflow modules: kept out of CLI start-up
    from rlaudit.report.mlflow_log import resolve_tracking_uri
    from rlaudit.report.warm import warm_report_imports  # lazy: as above

    uri = None if args.no_mlflow else resolve_tracking_uri(args.tracking_uri,
                                                           Path(args.report_dir))[0]
    warm_report_imports(mlflow_uri=uri)


def _plots_now(res, plots: dict) -> None:
    """Render ``res``'s report plots now, while later scenarios still run, instead of all of
    them after the last (--all: 14 s). Any problem is left for the report itself to meet."""
    try:
        # lazy: report and MLflow modules: kept out of CLI start-up
        from rlaudit.report.run_report import scenario_plots
        plots[id(res)] = scenario_plots(res)
    except Exception:  # noqa: BLE001 - _report renders it again and says what went wrong
        pass


def _report(results, args, plots: dict | None = None, interrupted: list[str] | None = None,
            shown: list | None = None) -> None:
    """Local report and MLflow logging; neither may lose the audit result if it fails.
    ``plots``: the report's plots rendered already (_plots_now); ``interrupted``: the scenarios
    a Ctrl-C stopped (MLflow: the invocation KILLED, not passed); ``shown``: what the local
    report lists (default ``results``: with a Ctrl-C, the stopped scenarios too)."""
    # lazy: report and MLflow modules: kept out of CLI start-up
    from rlaudit.report.warm import wait_for_warm_imports

    wait_for_warm_imports()  # what it imports is imported next: not from two threads at once
    report_dir = Path(args.report_dir)
    paths = None
    try:
        # lazy: report and MLflow modules: kept out of CLI start-up
        from rlaudit.report.run_report import write_run_report
        paths = write_run_report(results if shown is None else shown, report_dir, plots)
        print(f"report: {paths[0]}", file=sys.stderr)
    except ImportError:
        pass
    except Exception as e:  # the audit result stands; say what was not written
        print(f"rlaudit: warning: could not write the local report: {e}", file=sys.stderr)
    if args.no_mlflow:
        return
    try:
        # lazy: report and MLflow modules: kept out of CLI start-up
        from rlaudit.report.mlflow_log import log_invocation
    except ImportError as e:
        print(f"rlaudit: warning: MLflow logging unavailable ({e})", file=sys.stderr)
        return
    outcome = log_invocation(results, tracking_uri=args.tracking_uri, report_dir=report_dir,
                             report_files=paths, interrupted=interrupted)
    print(f"rlaudit: {outcome.message}", file=sys.stderr)
