"""Where ``rlaudit run`` carries out its scenario x backend jobs.

    local   this machine, two scenarios in flight; multi-rank backends (and the reference beside
            them) reuse warm rank pools (rlaudit/backends/launch/pool.py) for the whole
            invocation (the default)
    ray     Ray tasks and actors: every multi-rank job a placement group with one bundle per rank,
            the reference replays Ray tasks; a local Ray cluster, or ``--ray-address``

Both run each scenario through :func:`rlaudit.scenarios.engine.run_scenario`, handing it a
``replay(backend, request)`` that carries out one backend's replay: the variants, invariants,
goldens and reports are the same code whichever executor runs, only where the replays happen
differs. ``Executor.map(scenarios, run_one)`` yields ``(scenario, result)`` in the scenarios'
order, where ``run_one(scenario, replay)`` returns the scenario's result.

    with make_executor("local", scenarios, backends=None) as ex:
        for scn, res in ex.map(scenarios, lambda scn, replay: run_scenario(scn, replay=replay)):
            ...
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import threading
from typing import Callable, Iterator

from rlaudit.executors.progress import Progress

EXECUTORS = ("local", "ray")
#: Intra-op threads of the process that replays the reference backend and checks invariants:
#: 1, as in every rank and in the test suite. float64 results differ in the last bit between
#: thread counts, so a fixed count keeps them the same on every machine; and on a busy 2-core
#: machine two threads contending made the in-process reference replays several times slower.
#: RLAUDIT_THREADS overrides it.
DEFAULT_THREADS = 1


def process_threads() -> int:
    import os

    value = os.environ.get("RLAUDIT_THREADS", str(DEFAULT_THREADS))
    try:
        threads = int(value)
    except ValueError:
        threads = 0
    if threads < 1:
        from rlaudit.errors import InputError

        raise InputError(f"expected an integer >= 1, got {value!r}", source="environment",
                         key="RLAUDIT_THREADS")
    return threads


def _pooled(scn, backends: list[str] | None) -> list[tuple[str, int]]:
    """``(pool name, world size)`` of each of ``scn``'s backends that replays in a warm pool: the
    backends whose ``rank_pool(layout)`` names one (an unavailable backend needs none; the
    reference's one-rank pool is :func:`reference_pooled`'s)."""
    from rlaudit.backends.registry import get_backend
    from rlaudit.scenarios.engine import planned_backends

    out = []
    for b in planned_backends(scn, backends)[0]:
        backend = get_backend(b)
        rank_pool = getattr(backend, "rank_pool", None)
        if rank_pool is not None and backend.available()[0]:
            out.append(rank_pool(scn.backends.get(b, {})))
    return out


def reference_pooled(scn, backends: list[str] | None) -> bool:
    """Whether the local executor replays ``scn``'s reference backend in a one-rank warm pool
    rather than in its own process: on the CPU, when the scenario also replays on a multi-rank
    backend (whose ranks are forked from a forkserver that imports the model stack anyway; see
    :class:`LocalExecutor`)."""
    from rlaudit.scenarios.engine import planned_backends

    return (scn.device == "cpu" and "reference" in planned_backends(scn, backends)[0]
            and bool(_pooled(scn, backends)))


def needed_pools(scenarios, backends: list[str] | None) -> list[tuple[str, int, str, int]]:
    """``(pool name, world size, device, threads per rank)`` of every replay the scenarios will
    run in a warm pool -- the multi-rank ones and the reference where :func:`reference_pooled`
    -- in the order of first use."""
    from rlaudit.backends.reference import POOL

    out = []
    for scn in scenarios:
        if reference_pooled(scn, backends):
            out.append((POOL, 1, scn.device, process_threads()))
        out += [(*pool, scn.device, 1) for pool in _pooled(scn, backends)]
    return list(dict.fromkeys(out))


def groups_in_flight(scenarios, backends: list[str] | None, jobs: int) -> int:
    """How many multi-rank groups may replay at once: the ``jobs`` scenarios with the most
    pooled backends, each running all of them concurrently (what the placement of the pools'
    ranks on cores is sized for: rlaudit/backends/launch/placement.py; a pooled reference
    replay is one rank, never placed, and not counted)."""
    counts = sorted((len(_pooled(scn, backends)) for scn in scenarios), reverse=True)
    return max(1, sum(counts[:max(1, jobs)]))


def job_count(scenarios, backends: list[str] | None) -> int:
    """How many scenario x backend replays ``run_scenario`` will do (for the progress line)."""
    from rlaudit.scenarios.engine import planned_backends

    return sum(len(planned_backends(scn, backends)[0]) for scn in scenarios)


#: Scenarios the local executor keeps in flight: two, so that one scenario's one-core work (its
#: reference replay, its checks) overlaps another's multi-rank replay (the ranks).
LOCAL_JOBS = 2


class LocalExecutor:
    """Scenarios on this machine, ``jobs`` at a time (threads; results in scenario order), and
    within a scenario its backends at once (``concurrent_backends``). Multi-rank replays go to the
    warm pools of the enclosing :func:`~rlaudit.backends.launch.pool.warm_pools` block (the CLI holds
    one; a pool serves one task at a time), started in the background on entry (what
    :func:`needed_pools` lists for ``scenarios`` and ``backends``). The reference backend replays
    in a one-rank pool of its own too where :func:`reference_pooled` (a CPU scenario that also
    runs a multi-rank backend, inside a ``warm_pools`` block), else in this process, one replay at
    a time (each seeds the process's RNG). Results do not depend on ``jobs``, the overlap or where
    the reference replays: every replay is isolated, and a pooled reference replay is the
    in-process one, bit for bit (same code, same intra-op threads: :data:`DEFAULT_THREADS`).

    Why the reference goes to a pool beside multi-rank backends: their ranks are forked from a
    forkserver that imports torch, transformers and the model code anyway; replayed here, the
    reference makes this process import transformers and the model code a second time (~2.5
    CPU-s), on a machine whose cores the ranks already keep busy. Measured on 2 cores,
    alternating with the code before: ``drgrpo_sum_norm`` alone, 5 pairs, 31.9 -> 27.5 CPU-s and
    17.4 -> 16.1 s (medians); the six heaviest scenarios, twice, median 15.4 -> 14.3 and 13.6 ->
    12.8 s; ``run --all`` unchanged within the noise (the result transfer, ~0.2 s a scenario,
    takes back what the one import saves). (An earlier forkserver took longer to import, and a
    pooled reference then lost to one started at once here: `kl_k1` alone 35 s against 25 s.)"""

    name = "local"
    concurrent_backends = True

    def __init__(self, progress: Progress, *, jobs: int = LOCAL_JOBS, scenarios=(),
                 backends: list[str] | None = None, timeout: float = 300.0,
                 when_idle: Callable[[], object] | None = None):
        """``when_idle``: called once, when the first in-process replay is back -- or when the
        first pooled reference replay starts, if no reference replays in this process -- from
        then on this process only waits for ranks until the checks (the CLI imports the
        report's and MLflow's modules then: rlaudit.report.warm)."""
        self.progress = progress
        self.jobs = max(1, jobs)
        self.progress.parallel = self.jobs
        self._in_process = threading.Lock()
        self._idle_lock = threading.Lock()
        self._scenarios, self._backends, self._timeout = list(scenarios), backends, timeout
        self._when_idle = when_idle
        #: scenarios (ids) whose reference replays in a warm pool (set on entry:
        #: reference_pooled), and whether when_idle comes at the first of those replays
        self._pooled_reference: set[int] = set()
        self._idle_early = False

    def __enter__(self) -> "LocalExecutor":
        import torch

        from rlaudit.backends.launch.pool import active
        from rlaudit.cli.quiet import quiet_loggers
        from rlaudit.scenarios.engine import planned_backends

        warm = active()
        if warm is not None and self._scenarios:  # ranks start while this process loads
            from rlaudit.backends.launch import placement

            with_reference = [scn for scn in self._scenarios
                              if "reference" in planned_backends(scn, self._backends)[0]]
            self._pooled_reference = {id(scn) for scn in with_reference
                                      if reference_pooled(scn, self._backends)}
            # idle at the first pooled reference replay only if no reference replays here:
            # else after the first in-process one, which imports the model stack -- not while
            # the background imports run (rlaudit/report/warm.py)
            self._idle_early = len(self._pooled_reference) == len(with_reference)
            # fewer cores than ranks in flight: each group's tasks on cores of their own
            warm.place(placement.for_groups(groups_in_flight(self._scenarios, self._backends,
                                                             self.jobs)))
            warm.prestart(needed_pools(self._scenarios, self._backends), timeout=self._timeout)
        torch.set_num_threads(process_threads())
        quiet_loggers()  # torch's own log handler: its warnings go to the run's log file
        return self

    def __exit__(self, *exc) -> None:
        self.progress.close()

    def map(self, scenarios, run_one: Callable) -> Iterator[tuple]:
        if self.jobs == 1:
            for scn in scenarios:
                yield scn, run_one(scn, self._replayer(scn))
            return
        with concurrent.futures.ThreadPoolExecutor(self.jobs,
                                                   thread_name_prefix="rlaudit-job") as threads:
            futures = [threads.submit(run_one, scn, self._replayer(scn))
                       for scn in scenarios]
            try:
                for scn, future in zip(scenarios, futures):
                    yield scn, future.result()
            finally:
                for f in futures:
                    f.cancel()

    def _replayer(self, scn):
        def replay(backend, request):
            reference = backend.name == "reference"
            pooled = reference and id(scn) in self._pooled_reference
            if pooled and self._idle_early:
                self._idle()  # this process has no replay of its own: only ranks to wait for
            with self._in_process if reference and not pooled else contextlib.nullcontext():
                self.progress.start(scn.name, backend.name)
                try:
                    if pooled:
                        return backend.replay_in_pool(request, threads=process_threads())
                    return backend.replay(request)
                finally:
                    self.progress.finish(scn.name, backend.name)
                    if reference and not pooled:
                        self._idle()
        return replay

    def _idle(self) -> None:
        """``when_idle``, the first time only."""
        with self._idle_lock:
            idle, self._when_idle = self._when_idle, None
        if idle is not None:
            idle()


def make_executor(name: str, scenarios, *, backends: list[str] | None = None,
                  progress: bool = True, ray_address: str | None = None,
                  jobs: int = LOCAL_JOBS, timeout: float = 300.0,
                  when_idle: Callable[[], object] | None = None):
    """The executor called ``name`` (see :data:`EXECUTORS`) with a progress display over the
    scenarios' jobs. ``timeout``: what the multi-rank replays will be given (the local
    executor's prestarted pools take it as their process groups' timeout, as a pool started by
    the replay would). ``when_idle``: see :class:`LocalExecutor`."""
    total = job_count(scenarios, backends)
    if isinstance(jobs, bool) or not isinstance(jobs, int) or jobs < 1:
        from rlaudit.errors import InputError

        raise InputError(f"expected an integer >= 1, got {jobs!r}", key="--jobs")
    if name == "ray":
        from rlaudit.executors.ray_executor import RayExecutor

        return RayExecutor(total, address=ray_address, progress=progress,
                           gpu=any(scn.device == "cuda" for scn in scenarios))
    return LocalExecutor(Progress(total, enabled=progress), jobs=jobs, scenarios=scenarios,
                         backends=backends, timeout=timeout, when_idle=when_idle)


__all__ = ["EXECUTORS", "LocalExecutor", "Progress", "groups_in_flight", "job_count",
           "make_executor", "needed_pools"]
