"""Wall time of the whole audit of one TRL version: the built-in target scenario and the TRL
scenario family (scenarios/trl_*.yaml), every invariant, TRL and the reference backend.

    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/trl_audit.py [VERSION]   # e.g. 1.16.0

Prints the time per scenario, the total (TRL's import included), the per-invariant results
for TRL and any reference-column result that is not a pass or n/a. Exit 1 on any failure.
One intra-op thread: the models are tiny, and two threads on a shared 2-core box are ~100x
slower per matmul (measured: 15 ms vs 0.12 ms for a [2, 11, 128] x [128, 256] linear).
"""

from __future__ import annotations

import sys
import time
import warnings

import torch

T0 = time.perf_counter()


def main(version: str | None) -> int:
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    from rlaudit.targets.peers import activate
    activate("trl", version)
    from rlaudit.targets.peers.trl import TRLAdapter
    from rlaudit.targets.run.runner import run_target
    adapter = TRLAdapter()
    print(f"TRL {adapter.version} (import {time.perf_counter() - T0:.1f} s)")
    failed = 0
    for names in (None, ["trl_gradacc_uneven", "trl_seq_importance"]):
        t = time.perf_counter()
        results = run_target(adapter, scenario_names=names, stages=[])
        for r in results[1:]:
            print(f"\n{r.scenario}: {r.seconds:.1f} s")
            for c in r.checks:
                failed += c.status in ("fail", "error")
                if c.backend != adapter.name and c.status in ("pass", "n/a"):
                    continue
                who = "" if c.backend == adapter.name else f" [{c.backend}]"
                print(f"  {c.invariant + who:32s} {c.status:8s} {c.message[:120]}")
        print(f"  ({time.perf_counter() - t:.1f} s)")
    print(f"\nwhole audit of TRL {adapter.version}: {time.perf_counter() - T0:.1f} s wall, "
          f"{failed} failure(s)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else None))
