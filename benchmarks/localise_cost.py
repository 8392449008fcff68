"""What drift localisation costs on a failure, and that it costs nothing on a pass.

Runs one scenario twice through the engine: as it is (it must pass: no localisation runs), then
with one fault injected into a backend (rlaudit/backends/faults.py), and prints both wall times,
the localisation's own time (step/stage placement + the probe re-runs) and what it named.

    python benchmarks/localise_cost.py seed_entropy_coeff_zero --backend megatron \\
        --fault "megatron:rmsnorm_eps:layer=1,eps=1e-2"

Timings depend on the machine and its load (spawning ranks dominates on small CPU boxes).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rlaudit.scenarios import localise as L  # noqa: E402
from rlaudit.scenarios.engine import run_scenario  # noqa: E402
from rlaudit.scenarios.spec import load_scenario, resolve  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("scenario")
    p.add_argument("--backend", required=True, help="the backend the fault goes into")
    p.add_argument("--fault", required=True, help="RLAUDIT_FAULT spec, e.g. "
                   "'fsdp:softmax_scale:layer=0,factor=1.25'")
    p.add_argument("--scenarios-dir", default="scenarios")
    args = p.parse_args(argv)
    (path,) = resolve([args.scenario], all_=False, root=args.scenarios_dir)
    scn = load_scenario(path)
    spent = {"seconds": 0.0, "calls": 0}
    original = L.localise_scenario

    def timed(*a, **k):
        t = time.perf_counter()
        try:
            return original(*a, **k)
        finally:
            spent["seconds"] += time.perf_counter() - t
            spent["calls"] += 1

    L.localise_scenario = timed
    backends = ["reference", args.backend]
    os.environ.pop("RLAUDIT_FAULT", None)
    t = time.perf_counter()
    clean = run_scenario(scn, backends=backends)
    clean_s = time.perf_counter() - t
    print(f"clean:   {'passed' if clean.passed else 'FAILED'} in {clean_s:.1f}s; localisation "
          f"calls {spent['calls']}")
    os.environ["RLAUDIT_FAULT"] = args.fault
    t = time.perf_counter()
    faulty = run_scenario(scn, backends=backends)
    faulty_s = time.perf_counter() - t
    print(f"faulty:  {'passed' if faulty.passed else 'FAILED'} in {faulty_s:.1f}s; localisation "
          f"{spent['seconds']:.1f}s ({spent['calls']} call)")
    for e in faulty.localisation:
        probe = e.get("probe") or {}
        print(f"  [{e['backend']}] {e.get('summary')}; "
              f"probe re-runs {probe.get('seconds', 0):.1f}s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
