"""The local executor: ``rlaudit run``'s scenarios on this machine (the default; see
:mod:`rlaudit.executors`)."""

from __future__ import annotations

import concurrent.futures
import threading
import time
from typing import Callable, Iterator

import torch

from rlaudit import switches
from rlaudit.backends.launch import placement
from rlaudit.backends.launch.pool import active
from rlaudit.errors import RlauditError
from rlaudit.executors.planning import groups_in_flight, needed_pools, reference_pooled
from rlaudit.executors.progress import Progress
from rlaudit.executors.stop import Stopped, Stoppers
from rlaudit.quiet import quiet_loggers
from rlaudit.scenarios.engine import planned_backends

#: Seconds past a replay's timeout before a thread still waiting on ranks is stopped: the
#: ranks' own timeout comes first, with their stacks (a busy pool, or one still starting, has
#: none to give).
RANKS_GRACE_S = 10.0
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
    in-process one, bit for bit (same code, same intra-op threads:
    :data:`rlaudit.switches.DEFAULT_THREADS`).

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
        self._stoppers = Stoppers()
        self._interrupted = False

    def __enter__(self) -> "LocalExecutor":
        warm = active()
        if warm is not None and self._scenarios:  # ranks start while this process loads
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
        torch.set_num_threads(switches.threads())
        quiet_loggers()  # torch's own log handler: its warnings go to the run's log file
        return self

    def __exit__(self, exc_type, *exc) -> None:
        if exc_type is not None:  # a Ctrl-C (or a crash): no replay left running here
            self.interrupt()
        self.progress.close()

    def interrupt(self) -> None:
        """Stop every replay still running (in this process, or waited for on a warm pool's
        ranks, which are killed) and wait a bounded while for them to unwind
        (rlaudit/executors/stop.py). What a Ctrl-C does; idempotent."""
        self._interrupted = True
        self._stoppers.stop()
        self._stoppers.wait_idle()

    def map(self, scenarios, run_one: Callable) -> Iterator[tuple]:
        if self.jobs == 1:
            for scn in scenarios:
                yield scn, run_one(scn, self._replayer(scn))
            return
        # not a `with` block: leaving it would wait for every running replay (a Ctrl-C's wait)
        threads = concurrent.futures.ThreadPoolExecutor(self.jobs,
                                                        thread_name_prefix="rlaudit-job")
        try:
            futures = [threads.submit(run_one, scn, self._replayer(scn)) for scn in scenarios]
            for scn, future in zip(scenarios, futures):
                yield scn, future.result()
        finally:
            threads.shutdown(wait=False, cancel_futures=True)

    def _replayer(self, scn):
        def replay(backend, request):
            if self._interrupted:
                raise Stopped
            reference = backend.name == "reference"
            pooled = reference and id(scn) in self._pooled_reference
            if pooled and self._idle_early:
                self._idle()  # this process has no replay of its own: only ranks to wait for
            # the scenario's time left (the engine gives each request what remains of
            # --timeout) bounds a replay in this process by a timer; ranks by their own
            # timeout (their failure shows where they were stuck), the timer a backstop
            deadline = time.monotonic() + request.timeout
            here = reference and not pooled
            timer = threading.Timer(request.timeout + (0 if here else RANKS_GRACE_S),
                                    self._stoppers.stop, args=(scn.name,))
            timer.daemon = True
            timer.start()
            try:
                with self._stoppers.running(scn.name):
                    if here:
                        return self._replay_here(scn, backend, request, deadline)
                    return self._replay_timed(scn, backend, request, pooled)
            except Stopped:
                if self._interrupted:
                    raise
                raise RlauditError(over_time(scn.name, self._timeout)) from None
            finally:
                timer.cancel()
        return replay

    def _replay_here(self, scn, backend, request, deadline: float):
        """The reference replay in this process: one at a time (each seeds the process RNG)."""
        if not self._in_process.acquire(timeout=max(0.0, deadline - time.monotonic())):
            raise Stopped  # another scenario's replay held this process past the deadline
        try:
            return self._replay_timed(scn, backend, request, pooled=False)
        finally:
            self._in_process.release()
            self._idle()

    def _replay_timed(self, scn, backend, request, pooled: bool):
        self.progress.start(scn.name, backend.name)
        try:
            if pooled:
                return backend.replay_in_pool(request, threads=switches.threads())
            return backend.replay(request)
        finally:
            if not self._interrupted:  # a replay a Ctrl-C stopped did not finish
                self.progress.finish(scn.name, backend.name)

    def _idle(self) -> None:
        """``when_idle``, the first time only."""
        with self._idle_lock:
            idle, self._when_idle = self._when_idle, None
        if idle is not None:
            idle()


def over_time(scenario: str, limit: float) -> str:
    """The message of a replay stopped at its scenario's time limit."""
    return (f"scenario {scenario}: stopped at its time limit of {limit:g} s (--timeout); "
            "its replays did not finish")
