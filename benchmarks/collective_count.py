"""How many collectives each rank of ``rlaudit run`` issues, and from where.

    python benchmarks/collective_count.py kl_k1                   # every backend of the scenario
    python benchmarks/collective_count.py kl_k1 --backend megatron
    python benchmarks/collective_count.py kl_k1 --tree ../old-checkout

Runs ``rlaudit run`` (no MLflow, a temporary report directory) under suite_time's probe
(benchmarks/_probe/, with ``$RLAUDIT_PROBE_COLLECTIVES=1``) and prints, per rank process (grouped
by its rendezvous port), the number of ``torch.distributed`` calls and the seconds spent in them,
by call site. On a CPU box every gloo collective costs about a millisecond of wake-ups, so this
is where a multi-rank replay's overhead shows. Collectives FSDP2 issues from C++ are not counted.
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
PROBE = Path(__file__).resolve().parent / "_probe"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("scenario")
    p.add_argument("--backend", action="append", dest="backends", default=[])
    p.add_argument("--tree", type=Path, default=ROOT, help="the rlaudit checkout to measure")
    p.add_argument("--top", type=int, default=6, help="call sites shown per rank")
    a = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="rlaudit-collectives-") as tmp:
        events = Path(tmp) / "events.jsonl"
        env = dict(os.environ, RLAUDIT_PROBE_EVENTS=str(events), RLAUDIT_PROBE_COLLECTIVES="1",
                   PYTHONPATH=os.pathsep.join([str(PROBE), str(a.tree.resolve())]))
        cmd = [sys.executable, "-m", "rlaudit.cli.main", "run", a.scenario, "--no-mlflow",
               "--report-dir", str(Path(tmp) / "reports")]
        for b in a.backends:
            cmd += ["--backend", b]
        rc = subprocess.run(cmd, cwd=a.tree, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL).returncode
        lines = events.read_text().splitlines() if events.is_file() else []
    counts: dict = collections.defaultdict(collections.Counter)
    seconds: dict = collections.defaultdict(collections.Counter)
    for line in lines:
        e = json.loads(line)
        if e["ev"] == "collective" and e["rank"] is not None:
            rank = (e["port"], int(e["rank"]), e["pid"])
            counts[rank][f"{e['op']} @ {e['site']}"] += 1
            seconds[rank][f"{e['op']} @ {e['site']}"] += e["t1"] - e["t0"]
    print(f"# collectives per rank: rlaudit run {a.scenario} "
          f"{' '.join('--backend ' + b for b in a.backends)} ({a.tree.resolve()}), exit {rc}")
    for rank in sorted(counts):
        port, r, _ = rank
        print(f"group :{port} rank {r}: {sum(counts[rank].values())} collectives, "
              f"{sum(seconds[rank].values()):.2f} s inside")
        for key, n in counts[rank].most_common(a.top):
            print(f"  {n:6d} {seconds[rank][key]:7.2f} s  {key}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
