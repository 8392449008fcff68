"""How many collectives each rank of ``rlaudit run`` issues, and from where.

    python benchmarks/collective_count.py kl_k1                   # every backend of the scenario
    python benchmarks/collective_count.py kl_k1 --backend megatron
    python benchmarks/collective_count.py kl_k1 --tree ../old-checkout

Runs ``rlaudit run`` (no MLflow, a temporary report directory) with the counter in
benchmarks/_collectives/ on PYTHONPATH and prints, per rank process (grouped by its rendezvous
port), the number of ``torch.distributed`` calls and the seconds spent in them by call site. On
a CPU box every gloo collective costs about a millisecond of wake-ups, so this is where a
multi-rank replay's overhead shows. Collectives that FSDP2 issues from C++ are not counted.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROBE = Path(__file__).resolve().parent / "_collectives"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("scenario")
    p.add_argument("--backend", action="append", dest="backends", default=[])
    p.add_argument("--tree", type=Path, default=ROOT, help="the rlaudit checkout to measure")
    p.add_argument("--top", type=int, default=6, help="call sites shown per rank")
    a = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="rlaudit-collectives-") as tmp:
        out = Path(tmp) / "counts"
        out.mkdir()
        env = dict(os.environ, RLAUDIT_COLLECTIVES_DIR=str(out),
                   PYTHONPATH=os.pathsep.join([str(PROBE), str(a.tree.resolve())]))
        cmd = [sys.executable, "-m", "rlaudit.cli.main", "run", a.scenario, "--no-mlflow",
               "--report-dir", str(Path(tmp) / "reports")]
        for b in a.backends:
            cmd += ["--backend", b]
        rc = subprocess.run(cmd, cwd=a.tree, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL).returncode
        ranks = [json.loads(f.read_text()) for f in sorted(out.glob("*.json"))]
    print(f"# collectives per rank: rlaudit run {a.scenario} "
          f"{' '.join('--backend ' + b for b in a.backends)} ({a.tree.resolve()}), exit {rc}")
    groups = collections.defaultdict(list)
    for r in ranks:
        if r["rank"] is not None and r["counts"]:
            groups[r["port"]].append(r)
    for port, members in sorted(groups.items()):
        for r in sorted(members, key=lambda r: int(r["rank"])):
            counts, secs = r["counts"], r["seconds"]
            print(f"group :{port} rank {r['rank']}: {sum(counts.values())} collectives, "
                  f"{sum(secs.values()):.2f} s inside")
            for key, n in sorted(counts.items(), key=lambda kv: -kv[1])[:a.top]:
                print(f"  {n:6d} {secs[key]:7.2f} s  {key}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
