"""Where the time of ``rlaudit run`` goes: spawn, imports, model build/convert, rendezvous, replay
compute, checks, goldens, report and MLflow, per scenario x backend and in total; and how long the
CLI's quick commands take.

    python benchmarks/suite_time.py                       # rlaudit run --all, this checkout
    python benchmarks/suite_time.py --ref b75782f         # the same, on a commit (git worktree)
    python benchmarks/suite_time.py -- kl_k1 adv_rloo     # only these scenarios
    python benchmarks/suite_time.py --keep out/ -- --all  # keep events, results JSON, check list

It runs the real command (``rlaudit run ARGS --json``, MLflow in a temporary sqlite store) in a
subprocess with benchmarks/_probe/ first on PYTHONPATH: that folder's sitecustomize.py wraps a
fixed set of rlaudit functions from the outside in every process, the CLI's and each rank's,
and logs one line per timed call. The same probe therefore times any commit (``--ref``), so the
before/after figures come from one method. Phases (rank 0's view for multi-rank backends):

    spawn       process start-up and bootstrap, without the heavy imports (torch, megatron, ...)
    imports     first imports of the heavy third-party packages (torch, transformers, megatron,
                mlflow, ...), in the CLI process and in the ranks
    rendezvous  joining the process group, plus megatron's parallel_state set-up
    build       model load/copy/shard, HF -> megatron conversion, optimizers (per variant)
    compute     the replay itself (probe forward, train steps, recording)
    other       per backend: pickling, results, supervision, teardown; per scenario: rollout
                load and variants; per invocation: argument parsing, validation, printing
    queued      a multi-rank replay waiting for its warm pool: busy with another scenario's task,
                or still starting (pools start in the background, ahead of their first task)
    preload     (invocation) the forkserver's imports, in the background: CPU warm-pool ranks are
                forked from it with torch, transformers and megatron-core already loaded
    checks / golden / report / mlflow    invariant checks, golden comparison, local report, MLflow

Absolute figures depend on the machine and its load (say which when quoting them); shares are
what to compare between runs on a loaded machine. ``--keep DIR`` leaves events.jsonl,
results.json (the ``--json`` output) and checks.tsv (benchmarks/check_list.py) there.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROBE = ROOT / "benchmarks" / "_probe"
PHASES = ("spawn", "imports", "rendezvous", "build", "compute", "other", "queued")
QUICK = {"rlaudit list": ["list"], "rlaudit run --help": ["run", "--help"],
         "input error (unknown scenario)": ["run", "no_such_scenario"]}


def _driver(python: str, args: list[str]) -> list[str]:
    # the console script's entry point, not `-m rlaudit.cli.main`: a module run as __main__ is
    # not imported, so the probe could not wrap its main()
    return [python, "-c", "from rlaudit.cli.main import entry; entry()", *args]


def run_measured(tree: Path, python: str, args: list[str], work: Path) -> tuple[int, float]:
    events = work / "events.jsonl"
    env = dict(os.environ, RLAUDIT_PROBE_EVENTS=str(events),
               PYTHONPATH=os.pathsep.join([str(PROBE), str(tree)]),
               MLFLOW_TRACKING_URI=f"sqlite:///{work / 'mlflow.db'}")
    cmd = _driver(python, ["run", *args, "--json", "--report-dir", str(work / "reports")])
    t0 = time.perf_counter()
    with open(work / "results.json", "w") as out, open(work / "stderr.log", "w") as err:
        rc = subprocess.run(cmd, cwd=tree, env=env, stdout=out, stderr=err).returncode
    return rc, time.perf_counter() - t0


def quick_commands(tree: Path, python: str, repeat: int) -> dict[str, float]:
    env = dict(os.environ, PYTHONPATH=str(tree))
    out = {}
    for label, args in QUICK.items():
        times = []
        for _ in range(repeat):
            t0 = time.perf_counter()
            subprocess.run(_driver(python, args), cwd=tree, env=env, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL)
            times.append(time.perf_counter() - t0)
        out[label] = min(times)
    return out


# ---- analysis -----------------------------------------------------------------------------------

def _dur(e: dict) -> float:
    return e["t1"] - e["t0"]


def _inside(e: dict, w: dict) -> bool:
    return w["t0"] <= e["t0"] <= w["t1"]


def _same_thread(e: dict, w: dict) -> bool:
    return e.get("tid") == w.get("tid") and _inside(e, w)


def analyse(events: list[dict]) -> dict:
    """Per (scenario, backend) phases, per-scenario and per-invocation costs (seconds).

    Events of the CLI process are matched to a scenario or replay by thread and time (the
    local executor keeps two scenarios in flight); a rank's events to the pool task they fall in
    by the rank's MASTER_PORT (= the pool's port), or, for one-shot launches (which never
    overlap), by time."""
    cli = next(e for e in events if e["ev"] == "cli")
    parent = cli["pid"]
    start = next(e["t0"] for e in events if e["ev"] == "process" and e["pid"] == parent)
    mine = [e for e in events if e["pid"] == parent]
    ranks = [e for e in events if e["pid"] != parent]
    port_of = {e["pid"]: e["port"] for e in ranks if e.get("port")}
    for e in ranks:
        e["port"] = port_of.get(e["pid"])
    ranks = [e for e in ranks if e.get("rank") in ("0", None)]
    scenarios = [e for e in mine if e["ev"] == "scenario"]
    replays = [e for e in mine if e["ev"] == "replay"]
    rows = []
    of_scenario = {scn["scenario"]: _replays_of(scn, replays) for scn in scenarios}
    for scn in scenarios:
        for w in of_scenario[scn["scenario"]]:
            rows.append({"scenario": scn["scenario"], "backend": w["backend"], "wall": _dur(w),
                         **_replay_phases(w, mine, ranks)})
    per_scenario = {}
    for scn in scenarios:
        inside = [e for e in mine if _same_thread(e, scn)]
        # wall time covered by the scenario's replays (its backends may overlap)
        replay = _covered(of_scenario[scn["scenario"]])
        checks = sum(_dur(e) for e in inside if e["ev"] == "check")
        golden = sum(_dur(e) for e in inside if e["ev"] == "golden")
        imports = sum(_dur(e) for e in inside if e["ev"] == "import" and e["depth"] == 0
                      and not any(_inside(e, r) for r in replays))
        per_scenario[scn["scenario"]] = {
            "wall": _dur(scn), "replay": replay, "checks": checks, "golden": golden,
            "imports": imports, "other": _dur(scn) - replay - checks - golden - imports}
    first = min((s["t0"] for s in scenarios), default=cli["t1"])
    last = max((s["t1"] for s in scenarios), default=first)
    startup = first - start  # interpreter, parsing, loading and validating every scenario
    report = sum(_dur(e) for e in mine if e["ev"] == "report")
    mlflow = sum(_dur(e) for e in mine if e["ev"] == "mlflow")
    startup_imports = sum(_dur(e) for e in mine if e["ev"] == "import" and e["depth"] == 0
                          and e["t0"] < first)
    # background work: the forkserver's preload (a process of its own, no rank) and warm pools
    # started ahead of their first task
    others = [e for e in events if e["pid"] != parent and e.get("rank") is None]
    preload = sum(_dur(e) for e in others if e["ev"] == "import" and e["depth"] == 0)
    prestart = sum(_dur(e) for e in mine if e["ev"] == "launch"
                   and not any(_same_thread(e, w) for w in replays))
    invocation = {"wall": cli["t1"] - start, "startup": startup - startup_imports,
                  "startup_imports": startup_imports, "scenarios": last - first,
                  "report": report, "mlflow": mlflow,
                  "other": cli["t1"] - last - report - mlflow,
                  "preload": preload, "prestart": prestart,
                  "concurrent": len({s.get("tid") for s in scenarios}) > 1
                  or any(r.get("tid") != s.get("tid") for s in scenarios
                         for r in of_scenario[s["scenario"]])}
    return {"rows": rows, "scenarios": per_scenario, "invocation": invocation}


def _replays_of(scn: dict, replays: list[dict]) -> list[dict]:
    """The scenario's replays: by the scenario the probe names (replays may run in threads of
    their own), else -- a checkout whose probe events carry no name -- by thread and time."""
    return [r for r in replays if r.get("scenario") == scn["scenario"]
            or (r.get("scenario") is None and _same_thread(r, scn))]


def _covered(windows: list[dict]) -> float:
    """Wall time covered by the union of the windows."""
    total, end = 0.0, None
    for w in sorted(windows, key=lambda e: e["t0"]):
        if end is None or w["t0"] > end:
            total += _dur(w)
            end = w["t1"]
        elif w["t1"] > end:
            total += w["t1"] - end
            end = w["t1"]
    return total


def _replay_phases(w: dict, parent_events: list[dict], rank_events: list[dict]) -> dict:
    inside = [e for e in parent_events if _same_thread(e, w)]
    pooled = [e for e in inside if e["ev"] in ("task", "launch") and e.get("pool_port")]
    if pooled:  # a warm pool: this window's start-up and task, by the pool's port
        inside += [e for e in rank_events
                   if any(e["port"] == t["pool_port"] and _inside(e, t) for t in pooled)
                   or (e["ev"] == "process" and any(_inside(e, t) for t in pooled
                                                    if t["ev"] == "launch"))]
    elif any(e["ev"] == "launch" for e in inside):  # one-shot launches never overlap
        inside += [e for e in rank_events if _inside(e, w)]
    imps = [e for e in inside if e["ev"] == "import" and e["depth"] == 0]
    builds = [e for e in inside if e["ev"] in ("build", "convert")]

    def own(events, minus):
        """Time in ``events`` not spent in the ``minus`` events nested in them (same process)."""
        return sum(_dur(e) - sum(_dur(m) for m in minus if m["pid"] == e["pid"] and _inside(m, e))
                   for e in events)

    imports = sum(map(_dur, imps))
    rendezvous = own([e for e in inside if e["ev"] in ("rendezvous", "megatron_init")], imps)
    build = own(builds, imps)
    loose_imports = [m for m in imps if not any(_inside(m, b) for b in builds)]
    compute = own([e for e in inside if e["ev"] == "variant"], builds + loose_imports)
    # spawn: from the launch call to the rank's first rendezvous, less the imports it made
    spawn = 0.0
    launches = [e for e in inside if e["ev"] == "launch"]
    procs = [e for e in inside if e["ev"] == "process" and e["pid"] != w["pid"]]
    rdv = [e for e in inside if e["ev"] == "rendezvous"]
    if launches and procs and rdv:
        joined = min(e["t0"] for e in rdv)
        rank_imports = sum(_dur(e) for e in imps if e["pid"] != w["pid"] and e["t1"] <= joined)
        spawn = max(0.0, joined - launches[0]["t0"] - rank_imports)
    # waiting for the pool while it served another scenario's task (two scenarios in flight)
    queued = min(e["t0"] for e in pooled) - w["t0"] if pooled else 0.0
    known = spawn + imports + rendezvous + build + compute + queued
    return {"spawn": spawn, "imports": imports, "rendezvous": rendezvous, "build": build,
            "compute": compute, "other": max(0.0, _dur(w) - known), "queued": queued}


# ---- printing -----------------------------------------------------------------------------------

def render(result: dict, quick: dict[str, float], meta: dict) -> str:
    lines = [f"# rlaudit suite timing ({meta['tree']}, {meta['when']}, "
             f"load average at start {meta['load']:.2f}, {os.cpu_count()} cores)",
             f"command: rlaudit run {' '.join(meta['args'])}   exit code {meta['rc']}", ""]
    head = f"{'scenario':34s} {'backend':9s} {'wall':>7s} " + " ".join(f"{p:>10s}" for p in PHASES)
    lines += [head, "-" * len(head)]
    totals = defaultdict(float)
    by_backend = defaultdict(lambda: defaultdict(float))
    for r in result["rows"]:
        lines.append(f"{r['scenario']:34s} {r['backend']:9s} {r['wall']:7.1f} "
                     + " ".join(f"{r[p]:10.1f}" for p in PHASES))
        for p in ("wall", *PHASES):
            totals[p] += r[p]
            by_backend[r["backend"]][p] += r[p]
    lines.append("-" * len(head))
    for b, t in sorted(by_backend.items()):
        lines.append(f"{'(all scenarios)':34s} {b:9s} {t['wall']:7.1f} "
                     + " ".join(f"{t[p]:10.1f}" for p in PHASES))
    lines.append(f"{'(all scenarios)':34s} {'all':9s} {totals['wall']:7.1f} "
                 + " ".join(f"{totals[p]:10.1f}" for p in PHASES))
    inv = result["invocation"]
    wall = inv["wall"]
    checks = sum(s["checks"] for s in result["scenarios"].values())
    golden = sum(s["golden"] for s in result["scenarios"].values())
    scn_other = sum(s["other"] for s in result["scenarios"].values())
    scn_imports = sum(s["imports"] for s in result["scenarios"].values())
    lines += ["", f"invocation wall: {wall:.1f} s ({len(result['scenarios'])} scenarios, "
                  f"{len(result['rows'])} scenario x backend replays)", "share of the wall time:"]
    if inv.get("concurrent"):
        lines.append("  (scenarios ran concurrently: phases overlap, so the shares add up to more "
                     "than 100 %; 'queued' is a replay waiting for a pool busy with another)")
    if inv.get("preload") or inv.get("prestart"):
        lines.append("  (background, overlapping the rest: forkserver preload "
                     f"{inv.get('preload', 0.0):.1f} s, warm pools started ahead of their first "
                     f"task {inv.get('prestart', 0.0):.1f} s)")
    shares = [("CLI start-up: heavy imports", inv["startup_imports"]),
              ("CLI start-up: parse, load + validate", inv["startup"]),
              ("imports between replays (CLI process)", scn_imports)]
    shares += [(f"replay: {p}", totals[p]) for p in PHASES]
    shares += [("invariant checks", checks), ("golden comparison", golden),
               ("rollout load + variants + provenance", scn_other),
               ("local report", inv["report"]), ("MLflow logging", inv["mlflow"]),
               ("other (printing, JSON)", inv["other"])]
    for label, sec in shares:
        lines.append(f"  {label:40s} {sec:8.1f} s  {100 * sec / wall if wall else 0:5.1f} %")
    if result["scenarios"]:
        per = [s["wall"] for s in result["scenarios"].values()]
        lines.append(f"per scenario (all its backends): median {statistics.median(per):.1f} s, "
                     f"max {max(per):.1f} s")
    if quick:
        lines += ["", "quick commands (best of the runs, wall):"]
        lines += [f"  {k:40s} {v:6.2f} s" for k, v in quick.items()]
    return "\n".join(lines)


# ---- main ---------------------------------------------------------------------------------------

def _worktree(ref: str) -> Path:
    path = Path(tempfile.mkdtemp(prefix="rlaudit-bench-"))
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-q", str(path), ref],
                   check=True)
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ref", help="measure this commit instead of the checkout (a temporary git "
                                 "worktree; the probe comes from this checkout)")
    p.add_argument("--tree", type=Path, help="measure the rlaudit checkout in this folder")
    p.add_argument("--python", default=sys.executable, help="interpreter (default: this one)")
    p.add_argument("--keep", type=Path, help="keep events, results JSON and check list here")
    p.add_argument("--repeat", type=int, default=3, help="runs of each quick command")
    p.add_argument("--no-quick", action="store_true", help="skip the quick-command timings")
    p.add_argument("args", nargs="*", help="arguments of `rlaudit run` (default: --all)")
    a = p.parse_args(argv)
    args = a.args or ["--all"]
    tree = a.tree.resolve() if a.tree else _worktree(a.ref) if a.ref else ROOT
    work = Path(tempfile.mkdtemp(prefix="rlaudit-suite-time-"))
    try:
        load = os.getloadavg()[0]
        quick = {} if a.no_quick else quick_commands(tree, a.python, a.repeat)
        rc, _ = run_measured(tree, a.python, args, work)
        events = [json.loads(line) for line in (work / "events.jsonl").read_text().splitlines()]
        if not any(e["ev"] == "cli" for e in events):
            print((work / "stderr.log").read_text()[-3000:], file=sys.stderr)
            raise SystemExit("the measured run did not finish; its stderr is above")
        meta = {"tree": f"{tree} @ {_head(tree)}", "when": time.strftime("%Y-%m-%d %H:%M"),
                "load": load, "args": args, "rc": rc}
        result = analyse(events)
        print(render(result, quick, meta))
        if a.keep:
            a.keep.mkdir(parents=True, exist_ok=True)
            for name in ("events.jsonl", "results.json", "stderr.log"):
                shutil.copy(work / name, a.keep / name)
            (a.keep / "breakdown.json").write_text(json.dumps(
                {"meta": meta, "quick": quick, **result}, indent=1))
            env = dict(os.environ, PYTHONPATH=str(tree))
            with open(a.keep / "checks.tsv", "w") as out:
                subprocess.run([a.python, str(ROOT / "benchmarks" / "check_list.py"),
                                str(work / "results.json")], cwd=tree, env=env, stdout=out,
                               check=False)
        return 0
    finally:
        shutil.rmtree(work, ignore_errors=True)
        if a.ref and not a.tree:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)],
                           check=False)


def _head(tree: Path) -> str:
    out = subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"],
                         capture_output=True, text=True)
    return out.stdout.strip() or "?"


if __name__ == "__main__":
    sys.exit(main())
