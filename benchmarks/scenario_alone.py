"""How long one scenario takes on all its backends when it is the whole invocation: the wall time
of ``rlaudit run NAME`` (start-up, validation, every backend's replay, checks, goldens, report,
MLflow logging into a temporary sqlite store), for each scenario in turn.

    python benchmarks/scenario_alone.py                    # every scenario under scenarios/
    python benchmarks/scenario_alone.py kl_k1 adv_rloo     # these
    python benchmarks/scenario_alone.py --repeat 3 kl_k1   # best and worst of three
    python benchmarks/scenario_alone.py --tree ../other    # another checkout (same interpreter)

Prints one line per scenario (its backends, wall time, exit code) and the distribution, with
how many stay within ``--limit`` seconds (default 15). Run it on an idle machine; the load
average at the start is printed with the figures.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


def scenario_names(tree: Path) -> list[str]:
    return sorted(p.stem for p in (tree / "scenarios").glob("*.yaml"))


def backends_of(tree: Path, name: str) -> str:
    spec = yaml.safe_load((tree / "scenarios" / f"{name}.yaml").read_text())
    return ",".join(f"{b}{''.join(f' {k}={v}' for k, v in (lay or {}).items())}"
                    for b, lay in (spec.get("backends") or {}).items())


def time_one(tree: Path, python: str, name: str, work: Path) -> tuple[float, int]:
    env = dict(os.environ, PYTHONPATH=str(tree),
               MLFLOW_TRACKING_URI=f"sqlite:///{work / 'mlflow.db'}")
    # what the `rlaudit` console script runs (its entry point), from ``tree``
    cmd = [python, "-c", "from rlaudit.cli.main import entry; entry()", "run", name, "--report-dir", str(work / "reports")]
    t0 = time.perf_counter()
    rc = subprocess.run(cmd, cwd=tree, env=env, stdout=subprocess.DEVNULL,
                        stderr=subprocess.DEVNULL).returncode
    return time.perf_counter() - t0, rc


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("scenarios", nargs="*", help="scenario names (default: all)")
    p.add_argument("--tree", type=Path, default=ROOT, help="the rlaudit checkout to time")
    p.add_argument("--python", default=sys.executable)
    p.add_argument("--repeat", type=int, default=1, help="runs per scenario (best and worst shown)")
    p.add_argument("--limit", type=float, default=15.0, help="seconds counted as within the aim")
    a = p.parse_args(argv)
    tree = a.tree.resolve()
    names = a.scenarios or scenario_names(tree)
    print(f"# rlaudit run <scenario>, alone ({tree}, {time.strftime('%Y-%m-%d %H:%M')}, "
          f"load average at start {os.getloadavg()[0]:.2f}, {os.cpu_count()} cores)")
    print(f"{'scenario':34s} {'backends':36s} {'best':>7s} {'worst':>7s} exit")
    best = {}
    with tempfile.TemporaryDirectory(prefix="rlaudit-alone-") as tmp:
        work = Path(tmp)
        time_one(tree, a.python, names[0], work)  # warm the disk cache and the MLflow store
        for name in names:
            runs = [time_one(tree, a.python, name, work) for _ in range(max(1, a.repeat))]
            walls = [w for w, _ in runs]
            best[name] = min(walls)
            print(f"{name:34s} {backends_of(tree, name)[:36]:36s} {min(walls):7.1f} "
                  f"{max(walls):7.1f} {','.join(str(rc) for _, rc in runs)}", flush=True)
    walls = sorted(best.values())
    within = sum(w <= a.limit for w in walls)
    print(f"\n{len(walls)} scenarios: median {statistics.median(walls):.1f} s, "
          f"max {walls[-1]:.1f} s; {within} within {a.limit:g} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
