"""``rlaudit run --executor ray``: scenario x backend jobs on a Ray cluster.

    rlaudit run --all --executor ray                          # a local Ray cluster
    rlaudit run --all --executor ray --ray-address auto       # the cluster this node belongs to
    rlaudit run --all --executor ray --ray-address ray://head:10001 --device cuda

What runs where:

- the driver (this process) loads and validates the scenarios, builds the variants, checks the
  invariants and goldens, writes the report and logs to MLflow -- the same code as the local
  executor, so results, goldens, reports and MLflow runs are the same;
- every replay runs on Ray: multi-rank backends' ``run_ranks`` calls go to warm rank groups
  (rlaudit/executors/ray_ranks.py: one placement group per group, a bundle per rank, GPU bundles
  with ``--device cuda``), and the reference backend's replays to one-rank groups of the same
  kind (so a reference replay, too, runs on a cluster node, with the same thread count as a
  local run: rlaudit.switches.DEFAULT_THREADS);
- scenarios run concurrently, as many as the cluster has room for two-rank groups (a local
  cluster: one at a time per two cores), each scenario's backends in order.

A local cluster listens on loopback only (rlaudit/executors/ray_loopback.py). Ray starts
quietly: no dashboard, workers' output not forwarded (``log_to_driver=False``), usage
stats off (``RAY_USAGE_STATS_ENABLED=0``), its own messages into the run's log file. A local
cluster advertises a few more logical CPUs than the machine has (:data:`LOCAL_EXTRA_CPUS`) so
that a warm group of each backend (reference 1 rank, FSDP 2, Megatron 2) can stay up side by side
instead of being evicted in turn. Every node of a remote cluster needs rlaudit installed and the
scenarios' model and rollout files at the same paths as the driver (a shared checkout).
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
from typing import Callable, Iterator

from rlaudit import switches
from rlaudit.backends.launch import pool
from rlaudit.errors import InputError
from rlaudit.executors.progress import Progress
from rlaudit.executors.ray_address import probe_ray_address
from rlaudit.executors.ray_loopback import init_local_cluster
from rlaudit.executors.stop import Stopped, Stoppers
from rlaudit.executors.ray_ranks import RayPoolSet
from rlaudit.quiet import quiet_loggers

#: Logical CPUs a local Ray cluster gets beyond the machine's cores (see the module docstring).
LOCAL_EXTRA_CPUS = 4


class RayExecutor:
    name = "ray"
    concurrent_backends = True  # each replay is its own Ray rank group

    def __init__(self, total: int, *, address: str | None = None, progress: bool = True,
                 gpu: bool = False):
        # like ray.init itself, RAY_ADDRESS names the cluster when --ray-address does not
        self.address = address or os.environ.get("RAY_ADDRESS") or None
        self._flag_address = bool(address)
        self.gpu = gpu
        self.progress = Progress(total, enabled=progress)
        self.pools = None
        self._started_ray = False
        self._threads = None
        self._stoppers = Stoppers()
        self._interrupted = False

    def __enter__(self) -> "RayExecutor":
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        import ray  # lazy: optional (only --executor ray needs it), 1-2 s import
        import torch

        self._threads = switches.threads()  # the reference replays' threads, as in-process
        torch.set_num_threads(self._threads)  # and the driver's checks
        quiet_loggers()
        if not ray.is_initialized():
            quiet = dict(include_dashboard=False, log_to_driver=False, configure_logging=False,
                         logging_level=logging.WARNING)
            if self.address:
                # nothing listening there: ray.init would retry for minutes
                probe_ray_address(self.address, flag="--ray-address" if self._flag_address
                                  else "RAY_ADDRESS")
                try:
                    ray.init(address=self.address, **quiet)
                except (ConnectionError, TimeoutError) as e:  # it listens, but not Ray's GCS
                    raise InputError(f"cannot join a Ray cluster at {self.address}: {e}",
                                     key="--ray-address" if self._flag_address
                                     else "RAY_ADDRESS") from None
            else:  # a cluster of our own: listening on loopback only
                init_local_cluster(num_cpus=(os.cpu_count() or 1) + LOCAL_EXTRA_CPUS, **quiet)
            self._started_ray = True
        quiet_loggers()
        self.pools = RayPoolSet()
        pool.activate(self.pools)  # run_ranks now reaches Ray
        unit = "GPU" if self.gpu else "CPU"
        room = ray.cluster_resources().get(unit, 1) if self.address else (os.cpu_count() or 1)
        self.progress.parallel = max(1, int(room // 2))
        return self

    def __exit__(self, exc_type, *exc) -> None:
        import ray  # lazy: optional (only --executor ray needs it)

        if exc_type is not None:  # a Ctrl-C: stop waiting for the groups (killed below)
            self._interrupted = True
            self._stoppers.stop()
            self._stoppers.wait_idle()
        self.progress.close()
        pool.deactivate(self.pools)
        self.pools.close()
        if self._started_ray:
            ray.shutdown()

    def map(self, scenarios, run_one: Callable) -> Iterator[tuple]:
        # not a `with` block: leaving it would wait for every running replay (a Ctrl-C's wait)
        threads = concurrent.futures.ThreadPoolExecutor(self.progress.parallel,
                                                        thread_name_prefix="rlaudit-ray")
        try:
            futures = [threads.submit(run_one, scn, self._replayer(scn.name))
                       for scn in scenarios]
            for scn, future in zip(scenarios, futures):
                yield scn, future.result()
        finally:
            threads.shutdown(wait=False, cancel_futures=True)

    def _replayer(self, scenario: str):
        def replay(backend, request):
            if self._interrupted:
                raise Stopped
            # every replay is a Ray rank group, bounded by the request's timeout (what is left
            # of the scenario's --timeout); a Ctrl-C stops the thread waiting for it
            with self._stoppers.running(scenario):
                self.progress.start(scenario, backend.name)
                try:
                    if backend.name == "reference":
                        return backend.replay_in_pool(request, threads=self._threads)
                    return backend.replay(request)
                finally:
                    self.progress.finish(scenario, backend.name)
        return replay
