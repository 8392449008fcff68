"""Warm rank pools: a multi-rank group spawned once and reused for many tasks.

Starting a group costs seconds (each rank imports torch, transformers, megatron -- on CPU once,
in the forkserver it is forked from: ``_start`` -- and the group meets at the rendezvous) while a
scenario's replay on tiny models costs less. Inside
:func:`warm_pools`, :func:`run_ranks` sends each task to a pool kept per (name, world size,
device, backend, threads, env) instead of spawning a group for it::

    from rlaudit.backends.launch.pool import run_ranks, warm_pools

    with warm_pools() as pools:              # `rlaudit run`, and a pytest session, do this
        for request in requests:             # every request reuses the same two ranks
            per_rank = run_ranks(_rank_main, 2, pool="fsdp", args=(request,))
    pools.stats                              # {"spawned": 1, "tasks": N, "respawned": 0}

Outside :func:`warm_pools`, :func:`run_ranks` is exactly :func:`~rlaudit.backends.launch.launch`.

Same contract as ``launch``: ``fn`` importable, ``fn(info, *args, **kwargs)`` on every rank with
the default process group up, results in rank order on the CPU, and
:class:`~rlaudit.errors.RankFailure` (every rank's traceback, exit code, stacks and log tail,
causes first) when a rank raises, dies or is still running after ``timeout`` -- counted from
when the task was sent, since the ranks are already up. A failed task takes its group down: the
failure is reported for that task, and the next task gets a freshly spawned group. Between tasks
each rank restores its process state (``_pool_worker``), so a task's result does not depend on
what ran before it in the same pool.

Tasks of one pool run one at a time (a lock); different pools may run concurrently.
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import multiprocessing as mp
import multiprocessing.connection
import pickle
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

from rlaudit.backends.launch import rank_group, rendezvous, start
from rlaudit.backends.launch.launcher import (check_arguments, check_env, describe_fn, host_store,
                                              launch, no_main_reimport, pickle_payload, rank_spec,
                                              warn_teardown)
from rlaudit.backends.launch.common import MASTER_ADDR, register_task_reset
from rlaudit.backends.launch.rank_group import FAILURE_GRACE_S, RankGroup
from rlaudit.backends.launch.pool_worker import DONE, pool_rank_main
from rlaudit.backends.launch.outcomes import failure_message, order_outcomes
from rlaudit.errors import InputError, RankFailure

__all__ = ["PoolSet", "RankPool", "register_task_reset", "run_ranks", "warm_pools"]

#: How often the supervisor looks at result files between wake-ups (an answer or an exit on the
#: pipes wakes it at once).
_POLL_S = 0.05
#: How long closing a pool waits for its ranks to leave before killing them.
_CLOSE_WAIT_S = 5.0


class RankPool:
    """``world_size`` ranks that stay up between tasks (see the module docstring).

    ``spawned``: how many times the group was started (1 + respawns after failures)."""

    def __init__(self, world_size: int, *, device: str = "cpu", backend: str | None = None,
                 env: Mapping[str, str] | None = None, threads_per_rank: int = 1,
                 torch_timeout: float = rank_group.STARTUP_TIMEOUT_S):
        self.backend = check_arguments(world_size, backend, device, 1.0, threads_per_rank)
        self.world_size, self.device = world_size, device
        # a pool's ranks are local: their gloo/NCCL sockets on loopback (launch.rendezvous)
        self.env = {**check_env(env),
                    **rendezvous.rank_socket_env(MASTER_ADDR, backend=self.backend)}
        self.threads = threads_per_rank
        self.torch_timeout = max(torch_timeout, rank_group.STARTUP_TIMEOUT_S)
        self.spawned = 0
        self.tasks = 0
        self._lock = threading.Lock()
        self._group: RankGroup | None = None
        self._conns: list = []
        self._pool_files: list = []
        self._root: Path | None = None
        self._store = None
        self._ids = itertools.count()
        self._closed = False  # by close(): start() no longer brings it up (run() still does)
        #: where each task's ranks run (placement.CorePlacement; None: wherever the OS puts them)
        self.placement = None

    @property
    def alive(self) -> bool:
        return self._group is not None

    def run(self, fn: Callable[..., Any], *, args: tuple = (),
            kwargs: Mapping[str, Any] | None = None, timeout: float = 300.0) -> list[Any]:
        """Run ``fn(info, *args, **kwargs)`` on every rank of the pool; results in rank order."""
        if not isinstance(timeout, (int, float)) or not timeout > 0:
            check_arguments(self.world_size, self.backend, self.device, timeout, self.threads)
        if getattr(fn, "__module__", None) == "__main__":
            raise InputError(f"{describe_fn(fn)}: a warm pool's ranks do not import the main "
                             "script (they outlive it); put fn in a module, or use launch()",
                             source="run_ranks()", key="fn")
        payload = pickle_payload(fn, args, kwargs)
        with self._lock:
            if self._group is None:
                self._start(fn)
            self.tasks += 1
            return self._run_task(payload, describe_fn(fn), timeout)

    def start(self) -> None:
        """Start the ranks now, if they are not up (``run`` starts them on first use otherwise)
        and the pool was not closed meanwhile. A failure is raised here as it would be by
        ``run``; the next ``run`` spawns afresh."""
        with self._lock:
            if self._group is None and not self._closed:
                self._start(None)

    def close(self) -> None:
        """Ask the ranks to leave, kill what is left, remove the pool's folder. Idempotent."""
        with self._lock:
            self._closed = True
            self._shutdown()

    # ---- internals ------------------------------------------------------------------------------

    def _start(self, fn) -> None:
        self._root = Path(tempfile.mkdtemp(prefix="rlaudit-pool-"))
        self._store = host_store(self.torch_timeout)  # the launcher's rendezvous, kept open
        specs = [rank_spec(r, self.world_size, self.device, self.backend, self._root,
                       self._store.port, self.torch_timeout, self.threads, self.env)
                 for r in range(self.world_size)]
        ctx = start.context(self.device)  # CPU: forked from the preloaded forkserver
        pipes = [ctx.Pipe() for _ in specs]
        self._conns = [parent for parent, _ in pipes]
        group = RankGroup(specs, None, target=pool_rank_main,
                          extra_args=[(child,) for _, child in pipes], name="rlaudit-pool-rank",
                          ctx=ctx)
        self._pool_files = list(group.files)
        self._group = group
        self.spawned += 1
        try:
            with no_main_reimport(fn):  # fn is never from __main__ here (see run)
                group.start()
            for _, child in pipes:
                child.close()  # the ranks hold their ends; EOF here means a rank is gone
            why = self._wait_ready()
        except BaseException:
            self._shutdown()
            raise
        if why != "ready":
            self._fail(why, fn_name="the pool's start-up", timeout=rank_group.STARTUP_TIMEOUT_S)

    def _wait_ready(self) -> str:
        group = self._group
        deadline = time.monotonic() + rank_group.STARTUP_TIMEOUT_S
        first_failure = None
        while True:
            sentinels = {group.procs[r].sentinel: r for r in group.running()}
            exited = mp.connection.wait(list(sentinels), _POLL_S)
            now = time.monotonic()
            for sentinel in exited:
                group._collect(sentinels[sentinel])
                first_failure = first_failure or now
            if first_failure is not None:
                if now >= first_failure + FAILURE_GRACE_S:
                    return "failed"
            elif all(f.ready.exists() for f in group.files):
                return "ready"
            elif now >= deadline:
                return "timeout"

    def _run_task(self, payload: bytes, fn_name: str, timeout: float) -> list[Any]:
        import torch  # lazy: opening warm_pools() must not wait for torch

        group = self._group
        task_id = next(self._ids)
        task_dir = self._root / f"task{task_id}"
        (task_dir / "scratch").mkdir(parents=True)
        group.files = [f.for_task(task_dir, r) for r, f in enumerate(self._pool_files)]
        placement = self.placement
        cpus = (placement.acquire(self.world_size, device=self.device,
                                  threads_per_rank=self.threads) if placement else None)
        message = pickle.dumps(("task", task_id, str(task_dir), payload, cpus))
        try:
            for conn in self._conns:
                conn.send_bytes(message)
        except (BrokenPipeError, OSError):
            pass  # a rank is gone: supervision reports it
        try:
            why = self._supervise(timeout)
        except BaseException:  # the caller stopped waiting (Ctrl-C, its time limit): the
            group.kill_all()   # ranks are mid-task, so nothing to ask them; none outlives it
            self._shutdown()
            raise
        finally:
            if placement:
                placement.release(cpus)
        if why != "done":
            self._fail(why, fn_name=fn_name, timeout=timeout)
        try:
            results = [torch.load(f.result, map_location="cpu", weights_only=False)
                       for f in group.files]
        finally:
            shutil.rmtree(task_dir, ignore_errors=True)
        if group.exitcodes:  # a rank left after delivering: the results stand, the group does not
            warn_teardown(group)
            self._shutdown()
        return results

    def _supervise(self, timeout: float) -> str:
        """Wait until every rank has answered (result complete, process state restored):
        ``done``; ``failed`` (a rank exited without a result, plus the grace for the others' own
        errors) or ``timeout`` (a rank still running ``fn`` or its reset)."""
        group = self._group
        deadline = time.monotonic() + timeout
        first_failure = None
        answered: set[int] = set()
        while True:
            running = group.running()
            sentinels = {group.procs[r].sentinel: r for r in running}
            conns = {self._conns[r]: r for r in running if r not in answered}
            woke = mp.connection.wait([*sentinels, *conns], _POLL_S)
            now = time.monotonic()
            for obj in woke:
                if obj in conns:
                    with contextlib.suppress(EOFError, OSError):
                        if obj.recv_bytes().startswith(DONE):
                            answered.add(conns[obj])
                    continue
                rank = sentinels[obj]
                group._collect(rank)
                if group.has_result(rank):
                    answered.add(rank)  # left after delivering: the result stands
                else:
                    first_failure = first_failure or now
            if len(answered) == self.world_size:
                return "done"
            if first_failure is not None:
                if now >= first_failure + FAILURE_GRACE_S:
                    return "failed"
            elif now >= deadline:
                return "timeout"

    def _fail(self, why: str, *, fn_name: str, timeout: float) -> None:
        """Kill the group (stacks first for ranks without a result) and raise RankFailure."""
        group = self._group
        try:
            group.stop("timeout" if why == "timeout" else "terminated")
            outcomes = order_outcomes(group.outcomes())
        finally:
            self._shutdown()
        exc = RankFailure(failure_message(outcomes, fn_name=fn_name, world_size=self.world_size,
                                          timeout=timeout,
                                          startup_timeout=rank_group.STARTUP_TIMEOUT_S))
        exc.outcomes = outcomes
        raise exc

    def _shutdown(self) -> None:
        group, self._group = self._group, None
        if group is not None:
            message = pickle.dumps(("close",))
            for conn in self._conns:
                with contextlib.suppress(OSError):
                    conn.send_bytes(message)
            until = time.monotonic() + _CLOSE_WAIT_S
            while (running := group.running()) and time.monotonic() < until:
                # map before waiting: a collected process is closed and has no sentinel
                sentinels = {group.procs[r].sentinel: r for r in running}
                for sentinel in mp.connection.wait(list(sentinels), _POLL_S):
                    group._collect(sentinels[sentinel])
            group.kill_all()
        for conn in self._conns:
            with contextlib.suppress(OSError):
                conn.close()
        self._conns = []
        self._store = None  # closes the rendezvous port
        if self._root is not None:
            shutil.rmtree(self._root, ignore_errors=True)
            self._root = None


class PoolSet:
    """The warm pools of one invocation (or one pytest worker), created on first use."""

    def __init__(self):
        self._pools: dict[tuple, RankPool] = {}
        self._lock = threading.Lock()
        self._closed = False
        self._placement = None

    def place(self, placement) -> None:
        """Run every pool's tasks where ``placement`` (a :class:`placement.CorePlacement`, or
        None: anywhere) says, from their next task on."""
        with self._lock:
            self._placement = placement
            for p in self._pools.values():
                p.placement = placement

    def pool(self, name: str, world_size: int, *, device: str = "cpu",
             backend: str | None = None, env: Mapping[str, str] | None = None,
             threads_per_rank: int = 1, timeout: float = 300.0) -> RankPool:
        key = (name, world_size, device, backend, threads_per_rank,
               tuple(sorted((env or {}).items())))
        with self._lock:
            if self._closed:  # e.g. a prestart thread still going when the block ended
                raise RuntimeError("this set of warm pools is closed")
            if key not in self._pools:
                self._pools[key] = RankPool(world_size, device=device, backend=backend, env=env,
                                            threads_per_rank=threads_per_rank,
                                            torch_timeout=timeout)
                self._pools[key].placement = self._placement
            return self._pools[key]

    def prestart(self, keys, *, timeout: float = 300.0) -> threading.Thread:
        """Start the pools named by ``keys`` -- ``(name, world size, device, threads per rank)``
        in the order they will be needed -- one after the other in a background thread, so that
        their ranks start (fork, rendezvous) while this process does other work. A pool that
        fails to start is left to its first task, which spawns it afresh and reports the
        failure."""
        keys = list(dict.fromkeys(keys))

        def start_all():
            for name, world_size, device, threads in keys:
                try:
                    self.pool(name, world_size, device=device, threads_per_rank=threads,
                              timeout=timeout).start()
                except Exception:  # noqa: BLE001 - reported by the task that needs the pool
                    if self._closed:
                        return

        thread = threading.Thread(target=start_all, name="rlaudit-pool-prestart", daemon=True)
        thread.start()
        return thread

    @property
    def stats(self) -> dict[str, int]:
        pools = list(self._pools.values())
        spawned = sum(p.spawned for p in pools)
        return {"pools": len(pools), "spawned": spawned, "tasks": sum(p.tasks for p in pools),
                "respawned": spawned - sum(1 for p in pools if p.spawned)}

    def close(self) -> None:
        with self._lock:
            self._closed = True
        for p in list(self._pools.values()):
            p.close()


_ACTIVE: list[PoolSet] = []
_ACTIVE_LOCK = threading.Lock()


@contextlib.contextmanager
def warm_pools() -> Iterator[PoolSet]:
    """Within this block, :func:`run_ranks` reuses warm pools; they are closed on leaving it."""
    pools = PoolSet()
    activate(pools)
    try:
        yield pools
    finally:
        deactivate(pools)
        pools.close()


def activate(pools) -> None:
    """Make ``pools`` (a :class:`PoolSet`, or any object with its interface: the Ray executor's
    rank groups) the innermost active one: :func:`run_ranks` sends its tasks there."""
    with _ACTIVE_LOCK:
        _ACTIVE.append(pools)


def deactivate(pools) -> None:
    """Undo :func:`activate` (nothing if ``pools`` is not active)."""
    with _ACTIVE_LOCK:
        if pools in _ACTIVE:
            _ACTIVE.remove(pools)


def active() -> PoolSet | None:
    """The innermost active :class:`PoolSet`, or None."""
    with _ACTIVE_LOCK:
        return _ACTIVE[-1] if _ACTIVE else None


def run_ranks(fn: Callable[..., Any], world_size: int, *, pool: str, args: tuple = (),
              kwargs: Mapping[str, Any] | None = None, backend: str | None = None,
              device: str = "cpu", timeout: float = 300.0, env: Mapping[str, str] | None = None,
              threads_per_rank: int = 1) -> list[Any]:
    """:func:`~rlaudit.backends.launch.launch`, through the warm pool named ``pool`` when a
    :func:`warm_pools` block is active (one pool per name, world size, device, backend, threads
    and env)."""
    pools = active()
    if pools is None:
        return launch(fn, world_size, args=args, kwargs=kwargs, backend=backend, device=device,
                      timeout=timeout, env=env, threads_per_rank=threads_per_rank)
    return pools.pool(pool, world_size, device=device, backend=backend, env=env,
                      threads_per_rank=threads_per_rank, timeout=timeout).run(
        fn, args=args, kwargs=kwargs, timeout=timeout)


@atexit.register
def _close_all() -> None:  # a pytest worker or CLI that never left its block: no orphans
    for pools in list(_ACTIVE):
        pools.close()

