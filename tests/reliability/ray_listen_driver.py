"""Run by test_reliability_ray_loopback.py in a process of its own (a Ray driver):

    python ray_listen_driver.py

starts the local Ray cluster the way ``rlaudit run --executor ray`` does (RayExecutor), runs a
two-rank group on it (rank actors, their rendezvous store and gloo pairs, held warm), and prints
one JSON line: ``{"process[pid]": ["ip:port", ...]}`` for every TCP socket that this process or
any process under it (GCS, raylet, agents, workers) listens on, while the cluster is up.
"""

from __future__ import annotations

import json
import os
import sys

import psutil
import ray  # noqa: F401  imported before rlaudit starts the cluster, as a user's script may

from rlaudit.executors.ray_executor import RayExecutor


def all_reduced(info):
    import torch
    import torch.distributed as dist
    dist.all_reduce(torch.ones(1))  # the gloo pairs are connected
    return os.getpid()


def listening() -> dict[str, list[str]]:
    me = psutil.Process()
    out: dict[str, list[str]] = {}
    for proc in [me, *me.children(recursive=True)]:
        try:
            name, conns = proc.name(), proc.net_connections(kind="inet")
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        for c in conns:
            if c.status == psutil.CONN_LISTEN:
                out.setdefault(f"{name}[{proc.pid}]", []).append(f"{c.laddr.ip}:{c.laddr.port}")
    return out


def main() -> int:
    from ray_listen_driver import all_reduced as by_name  # by module name, as Ray workers import

    with RayExecutor(1, progress=False) as executor:
        executor.pools.pool("listen", 2).run(by_name, timeout=120)
        seen = listening()
    print(json.dumps(seen))
    return 0


if __name__ == "__main__":
    sys.exit(main())
