"""What a gloo collective costs two CPU ranks, floating over the machine's cores or both on one
core -- the measurement behind rlaudit/backends/launch/placement.py.

    python benchmarks/rank_placement.py               # 2000 of each collective per size
    python benchmarks/rank_placement.py --n 500

For each message size: wall time per all-reduce and per all-gather, and the CPU (user, system)
each rank spends on one -- the rank's whole process, gloo's threads included -- first with the
two ranks free to run on any core, then with both on the first. Where the CPU is the bottleneck
(more ranks than cores), CPU per collective is what a replay pays. Run it on an idle machine.
"""

from __future__ import annotations

import argparse
import os
import resource
import socket
import sys
import time

SIZES = (8, 1024, 30720, 307200)  # bytes: a scalar ... a [30, 1, 128] float64 activation ...


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, port: int, n: int, cores, queue) -> None:
    import torch
    import torch.distributed as dist

    if cores is not None:
        os.sched_setaffinity(0, cores)  # before gloo starts its threads: they inherit it
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    rows = []
    for size in SIZES:
        x = torch.ones(size // 8, dtype=torch.float64)
        out = torch.empty(2 * x.numel(), dtype=torch.float64)
        for name, op in (("all_reduce", lambda: dist.all_reduce(x)),
                         ("all_gather", lambda: dist.all_gather_single(out, x))):
            for _ in range(50):
                op()
            dist.barrier()
            r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
            for _ in range(n):
                op()
            r1, t1 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
            rows.append((name, size, (t1 - t0) / n, (r1.ru_utime - r0.ru_utime) / n,
                         (r1.ru_stime - r0.ru_stime) / n))
    queue.put((rank, rows))
    dist.destroy_process_group()


def measure(n: int, cores) -> list[tuple]:
    """Rows (collective, bytes, wall s, user s, system s) averaged over both ranks."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, n, cores, queue)) for r in range(2)]
    for p in procs:
        p.start()
    got = dict(queue.get(timeout=600) for _ in procs)
    for p in procs:
        p.join()
    return [(a[0], a[1], *((x + y) / 2 for x, y in zip(a[2:], b[2:])))
            for a, b in zip(got[0], got[1])]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=2000, help="collectives of each kind per size")
    a = p.parse_args(argv)
    if not hasattr(os, "sched_setaffinity"):
        print("this platform cannot pin threads (no os.sched_setaffinity)")
        return 0
    cpus = sorted(os.sched_getaffinity(0))
    print(f"# gloo, 2 ranks, {a.n} of each ({time.strftime('%Y-%m-%d %H:%M')}, load average "
          f"{os.getloadavg()[0]:.2f}, usable cores {cpus})")
    print(f"{'placement':22s} {'collective':11s} {'bytes':>7s} {'wall us':>8s} "
          f"{'user us':>8s} {'sys us':>7s} {'cpu us':>7s}")
    for label, cores in (("floating", None), (f"both on core {cpus[0]}", {cpus[0]})):
        for name, size, wall, user, system in measure(a.n, cores):
            print(f"{label:22s} {name:11s} {size:7d} {wall * 1e6:8.0f} {user * 1e6:8.0f} "
                  f"{system * 1e6:7.0f} {(user + system) * 1e6:7.0f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
