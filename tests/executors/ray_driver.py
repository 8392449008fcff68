"""Driver for tests/executors/test_ray_executor.py, run in its own process (a Ray driver).

    python ray_driver.py LOCAL_DIR LOCAL_URI REPORT_DIR TRACKING_URI

0. ``rlaudit run seed_stored_kl --backend fsdp --json`` with the local executor, in this process
   before Ray starts (its warm pool is closed when the run ends); the JSON goes to
   LOCAL_DIR/results.json. One process for both executors: the same thread count for the
   reference replay, as a user's two invocations would have, without paying the imports twice.
1. ``rlaudit run seed_stored_kl --backend fsdp --executor ray --json`` on a local Ray cluster
   (started here, so the same cluster serves step 2); the JSON goes to REPORT_DIR/results.json.
2. Failures on Ray rank groups: rank 1 raises; the next task runs on a fresh group (other
   processes); then rank 1's worker dies (``os._exit``: a lost worker). One JSON line on stdout
   says what was seen.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys

import torch
import torch.distributed as dist


def sum_ranks(info, scale):
    x = torch.tensor([float(info.rank + 1) * scale], dtype=torch.float64)
    dist.all_reduce(x)
    return {"sum": float(x), "pid": os.getpid()}


def fail(info, mode):
    if info.rank == 1:
        if mode == "raise":
            raise ValueError("injected failure in rank 1")
        os._exit(7)  # the worker process vanishes: Ray reports the actor dead
    dist.all_reduce(torch.ones(1))
    return info.rank


def main() -> int:
    import ray

    from rlaudit.cli.main import main as rlaudit
    from rlaudit.errors import RankFailure
    from rlaudit.executors.ray_ranks import RayPoolSet

    local_dir, local_uri, report_dir, uri = sys.argv[1:5]

    def run(*extra, report_dir, uri):
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            rc = rlaudit(["run", "seed_stored_kl", "--backend", "fsdp", *extra, "--json",
                          "--report-dir", report_dir, "--tracking-uri", uri])
        with open(os.path.join(report_dir, "results.json"), "w") as f:
            f.write(out.getvalue())
        return rc

    seen = {"local_rc": run(report_dir=local_dir, uri=local_uri)}
    ray.init(num_cpus=6, include_dashboard=False, log_to_driver=False, configure_logging=False)
    seen["rc"] = run("--executor", "ray", report_dir=report_dir, uri=uri)
    pools = RayPoolSet()
    handle = pools.pool("t", 2)
    from ray_driver import fail, sum_ranks  # by module name, which Ray workers can import
    first = handle.run(sum_ranks, args=(2.0,))
    seen["ok"] = [r["sum"] for r in first]

    def failing(mode):
        try:
            handle.run(fail, args=(mode,), timeout=120)
            return "no failure"
        except RankFailure as e:
            return str(e)

    seen["raise"] = failing("raise")
    # the next task gets a fresh group, which works (and is the one whose worker dies next)
    after = handle.run(sum_ranks, args=(1.0,))
    seen["after"] = [r["sum"] for r in after]
    seen["fresh"] = {r["pid"] for r in after}.isdisjoint(r["pid"] for r in first)
    seen["die"] = failing("die")
    seen["stats"] = pools.stats
    pools.close()
    ray.shutdown()
    print(json.dumps(seen))
    return 0


if __name__ == "__main__":
    sys.exit(main())
