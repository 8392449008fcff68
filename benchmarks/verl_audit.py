"""Wall time of the audit of one verl release with train_step: the stage checks and the built-in
target scenario (every invariant), each of verl's engines (its own column: verl-fsdp-<v>,
verl-megatron-<v>; on 0.9 the two engines' ranks run side by side, verl_step.shared_outputs),
and the reference backend. The load average is printed before and after: the ranks are
CPU-bound, so other load on the box moves the figure by tens of seconds.

    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/verl_audit.py [VERSION]   # e.g. 0.9.1

Prints the time of the stage checks and of the scenario, the total (verl's import included), the
per-invariant results of verl's columns and any reference-column result that is not a pass or
n/a. Exit 1 on any failure. One intra-op thread, as benchmarks/trl_audit.py says why.
"""

from __future__ import annotations

import os
import sys
import time
import warnings

import torch

T0 = time.perf_counter()
#: the box's load before anything of the audit ran (1, 5, 15 minutes)
LOAD = os.getloadavg()


def main(version: str | None) -> int:
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    from rlaudit.targets.peers import activate
    activate("verl", version)
    from rlaudit.targets.peers.verl import VerlAdapter
    from rlaudit.targets.run.runner import run_target
    adapter = VerlAdapter()
    print(f"verl {adapter.version} (import {time.perf_counter() - T0:.1f} s; load average "
          f"{LOAD[0]:.2f} {LOAD[1]:.2f} {LOAD[2]:.2f})")
    failed = 0
    results = run_target(adapter)
    mine = {adapter.name, *(e.name for e in getattr(adapter, "engines", ()))}
    for r in results:
        print(f"\n{r.scenario}: {r.seconds:.1f} s")
        for c in r.checks:
            failed += c.status in ("fail", "error")
            if c.backend not in mine and c.status in ("pass", "n/a"):
                continue
            who = "" if c.backend == adapter.name else f" [{c.backend}]"
            print(f"  {c.invariant + who:40s} {c.status:8s} {c.message[:120]}")
    end = os.getloadavg()
    print(f"\nwhole audit of verl {adapter.version}: {time.perf_counter() - T0:.1f} s wall, "
          f"{failed} failure(s); load average {end[0]:.2f} {end[1]:.2f} {end[2]:.2f}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else None))
