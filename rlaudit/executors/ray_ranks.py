"""Rank groups on Ray: the Ray counterpart of a warm rank pool (rlaudit/backends/launch/pool.py).

A group is one placement group with a bundle per rank (``{"CPU": 1}``, plus ``{"GPU": 1}`` with
``device="cuda"``), ``STRICT_PACK`` so that a group's ranks share a node (they meet on that
node's loopback: rank 0 hosts the TCP store on 127.0.0.1), and one :class:`RankActor` per bundle.
The cluster spreads different groups over its nodes. A group serves tasks one at a time exactly
like a pool: ``fn(info, *args, **kwargs)`` on every rank with the default process group up, the
process state restored after each task (``_pool_worker.ProcessState``), results in rank order.

Failures are reported as the launcher reports them, :class:`~rlaudit.errors.RankFailure` with one
:class:`~rlaudit.backends.launch.RankOutcome` per rank that did not deliver, causes first: a rank
whose task raised (``raised``, with its traceback), a rank whose actor died or whose node was
lost (``died``), ranks still running at the deadline (``timeout``) or when another failed
(``terminated``). Stacks of stuck ranks are not dumped (the driver may be on another node). A
failed group is killed (actors and placement group) and the next task gets a new one.

:class:`RayPoolSet` has :class:`~rlaudit.backends.launch.pool.PoolSet`'s interface, so the
backends' ``run_ranks`` calls reach Ray unchanged while the Ray executor holds it.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import shutil
import tempfile
import threading
import time
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Mapping

from rlaudit.backends.launch import rendezvous
from rlaudit.backends.launch.common import RankInfo
from rlaudit.backends.launch.launcher import describe_fn, pickle_payload
from rlaudit.backends.launch.outcomes import RankOutcome, failure_message, order_outcomes
from rlaudit.backends.launch.pool_worker import ProcessState
from rlaudit.backends.launch.rank_group import FAILURE_GRACE_S, STARTUP_TIMEOUT_S
from rlaudit.backends.launch.worker import is_peer_lost
from rlaudit.errors import RankFailure

#: How long a new group may wait for its placement group before an idle group of another key is
#: evicted to make room (seconds).
_PLACEMENT_WAIT_S = 2.0


class RankActor:
    """One rank (decorated with ``ray.remote`` at run time; see :func:`_actor_class`)."""

    def __init__(self, rank: int, world_size: int, device: str, backend: str, threads: int,
                 env: dict[str, str]):
        os.environ.update(env)
        os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world_size),
                           "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world_size),
                           "OMP_NUM_THREADS": str(threads)})
        import torch  # lazy: the Ray worker imports torch only after OMP_NUM_THREADS is set

        torch.set_num_threads(threads)
        self.rank, self.world_size, self.device_type = rank, world_size, device
        self.backend, self.threads = backend, threads
        self._store = None
        self.info = None
        self.state = None

    def host_store(self, timeout_s: float) -> int:
        """Rank 0: start the group's TCP store on this node's loopback; return its port."""
        # bound to loopback only: torch's own store would listen on every interface
        self._store = rendezvous.rendezvous_store(rendezvous.LOOPBACK, timeout=timeout_s)
        return self._store.port

    def join(self, port: int, timeout_s: float) -> int:
        """Initialise the default process group from rank 0's store; return this process's pid."""
        import torch  # lazy: the Ray worker imports torch only after OMP_NUM_THREADS is set
        import torch.distributed as dist  # lazy: as torch

        timeout = timedelta(seconds=timeout_s)
        device = torch.device("cpu")
        device_id = None
        if self.device_type == "cuda":  # Ray made one GPU visible to this actor
            device = torch.device("cuda", 0)
            torch.cuda.set_device(device)
            device_id = device if self.backend == "nccl" else None
        # the group's gloo/NCCL sockets on the node's loopback, like its store
        os.environ.update(rendezvous.rank_socket_env(rendezvous.LOOPBACK, backend=self.backend))
        store = self._store or dist.TCPStore("127.0.0.1", port, self.world_size, is_master=False,
                                             timeout=timeout)
        dist.init_process_group(self.backend, store=store, rank=self.rank,
                                world_size=self.world_size, timeout=timeout, device_id=device_id)
        self.info = RankInfo(rank=self.rank, world_size=self.world_size, local_rank=self.rank,
                             device=device, backend=self.backend, tmpdir=Path("."))
        self.state = ProcessState.capture(self.threads, self.device_type)
        return os.getpid()

    def run(self, payload: bytes, tmpdir: str) -> Any:
        """Run one task; restore the process state; return the result."""
        scratch = Path(tmpdir)
        scratch.mkdir(parents=True, exist_ok=True)  # ranks share a node: one folder for all
        fn, args, kwargs = pickle.loads(payload)
        try:
            return fn(dataclasses.replace(self.info, tmpdir=scratch), *args, **kwargs)
        finally:
            del fn, args, kwargs
            self.state.restore()
            if self.rank == 0:
                shutil.rmtree(scratch, ignore_errors=True)


def _actor_class():
    import ray  # lazy: optional (only --executor ray needs it), 1-2 s import

    return ray.remote(RankActor)


class RayGroup:
    """``world_size`` RankActors in one placement group, joined in one process group."""

    def __init__(self, pg, actors: list, pids: list[int]):
        self.pg, self.actors, self.pids = pg, actors, pids

    def run(self, payload: bytes, fn_name: str, timeout: float) -> list[Any]:
        import ray  # lazy: optional (only --executor ray needs it)
        from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError  # lazy: as ray

        tmpdir = os.path.join(tempfile.gettempdir(), f"rlaudit-ray-{uuid.uuid4().hex[:12]}")
        refs = [a.run.remote(payload, tmpdir) for a in self.actors]
        rank_of = {ref: r for r, ref in enumerate(refs)}
        results: dict[int, Any] = {}
        outcomes: dict[int, RankOutcome] = {}
        deadline = time.monotonic() + timeout
        first_failure = None
        pending = list(refs)
        while pending:
            limit = deadline if first_failure is None else min(deadline,
                                                                 first_failure + FAILURE_GRACE_S)
            ready, pending = ray.wait(pending, num_returns=1,
                                      timeout=max(0.0, limit - time.monotonic()))
            if not ready:
                break
            ref = ready[0]
            rank = rank_of[ref]
            try:
                results[rank] = ray.get(ref, timeout=0)
            except RayTaskError as e:
                outcomes[rank] = _raised(rank, e)
            except (RayActorError, GetTimeoutError) as e:
                outcomes[rank] = RankOutcome(rank, "died", time.time(), log_tail=str(e)[-4000:])
            if outcomes and first_failure is None:
                first_failure = time.monotonic()
        if len(results) == len(refs):
            return [results[r] for r in range(len(refs))]
        kind = "terminated" if outcomes else "timeout"
        for ref in pending:
            outcomes[rank_of[ref]] = RankOutcome(rank_of[ref], kind, time.time(), phase="fn")
        ordered = order_outcomes(list(outcomes.values()))
        exc = RankFailure(failure_message(ordered, fn_name=fn_name, world_size=len(refs),
                                          timeout=timeout, startup_timeout=STARTUP_TIMEOUT_S)
                          + "\n(Ray executor: stacks of stuck ranks are not dumped)")
        exc.outcomes = ordered
        raise exc

    def kill(self) -> None:
        import ray  # lazy: optional (only --executor ray needs it)
        from ray.util.placement_group import remove_placement_group  # lazy: as ray

        for a in self.actors:
            try:
                ray.kill(a, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass
        try:
            remove_placement_group(self.pg)
        except Exception:  # noqa: BLE001
            pass


def _raised(rank: int, e) -> RankOutcome:
    cause = getattr(e, "cause", None) or e
    return RankOutcome(rank, "raised", time.time(), phase="fn",
                       exc_type=f"{type(cause).__module__}.{type(cause).__qualname__}",
                       message=str(cause), traceback=getattr(e, "traceback_str", None) or str(e),
                       peer_lost=is_peer_lost(cause))


class RayPoolSet:
    """Warm Ray rank groups per (name, world size, device, backend, threads, env): the
    :class:`~rlaudit.backends.launch.pool.PoolSet` interface, so ``run_ranks`` reaches Ray."""

    def __init__(self):
        self._idle: dict[tuple, list[RayGroup]] = {}
        self._cond = threading.Condition()
        self.spawned = self.tasks = self.failed = 0

    def pool(self, name: str, world_size: int, *, device: str = "cpu",
             backend: str | None = None, env: Mapping[str, str] | None = None,
             threads_per_rank: int = 1, timeout: float = 300.0) -> "_Handle":
        backend = backend or ("nccl" if device == "cuda" else "gloo")
        key = (name, world_size, device, backend, threads_per_rank,
               tuple(sorted((env or {}).items())))
        return _Handle(self, key, max(timeout, STARTUP_TIMEOUT_S))

    @property
    def stats(self) -> dict[str, int]:
        return {"spawned": self.spawned, "tasks": self.tasks, "failed": self.failed}

    def close(self) -> None:
        with self._cond:
            groups = [g for gs in self._idle.values() for g in gs]
            self._idle.clear()
        for g in groups:
            g.kill()

    # ---- groups ---------------------------------------------------------------------------------

    def acquire(self, key: tuple, torch_timeout: float) -> RayGroup:
        while True:
            with self._cond:
                if self._idle.get(key):
                    return self._idle[key].pop()
            group = self._create(key, torch_timeout)
            if group is not None:
                return group
            with self._cond:  # no room: evict an idle group of another kind, or wait for one
                victims = [(k, gs) for k, gs in self._idle.items() if gs and k != key]
                if victims:
                    victims[0][1].pop(0).kill()
                else:
                    self._cond.wait(_PLACEMENT_WAIT_S)

    def release(self, key: tuple, group: RayGroup) -> None:
        with self._cond:
            self._idle.setdefault(key, []).append(group)
            self._cond.notify_all()

    def _create(self, key: tuple, torch_timeout: float) -> RayGroup | None:
        # lazy: ray is optional (only --executor ray needs it)
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group  # lazy: ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy  # lazy: ray

        name, world, device, backend, threads, env = key
        bundle = {"CPU": 1, **({"GPU": 1} if device == "cuda" else {})}
        pg = placement_group([dict(bundle) for _ in range(world)], strategy="STRICT_PACK")
        ready, _ = ray.wait([pg.ready()], timeout=_PLACEMENT_WAIT_S)
        if not ready:
            remove_placement_group(pg)
            return None
        actor_cls = _actor_class()
        actors = [actor_cls.options(
            num_cpus=1, num_gpus=1 if device == "cuda" else 0,
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=pg, placement_group_bundle_index=r),
            name=None).remote(r, world, device, backend, threads, dict(env))
            for r in range(world)]
        group = RayGroup(pg, actors, [])
        try:
            port = ray.get(actors[0].host_store.remote(torch_timeout), timeout=STARTUP_TIMEOUT_S)
            group.pids = ray.get([a.join.remote(port, torch_timeout) for a in actors],
                                 timeout=STARTUP_TIMEOUT_S)
        except Exception as e:
            group.kill()
            outcome = RankOutcome(0, "died", time.time(), log_tail=f"{type(e).__name__}: {e}")
            raise RankFailure(failure_message([outcome], fn_name=f"the start of a {name} group",
                                              world_size=world, timeout=STARTUP_TIMEOUT_S,
                                              startup_timeout=STARTUP_TIMEOUT_S)) from e
        with self._cond:
            self.spawned += 1
        return group


class _Handle:
    """What ``RayPoolSet.pool`` returns: ``run`` borrows a warm group of its key for one task."""

    def __init__(self, pools: RayPoolSet, key: tuple, torch_timeout: float):
        self._pools, self._key, self._torch_timeout = pools, key, torch_timeout

    def run(self, fn: Callable[..., Any], *, args: tuple = (),
            kwargs: Mapping[str, Any] | None = None, timeout: float = 300.0) -> list[Any]:
        payload = pickle_payload(fn, args, kwargs)
        group = self._pools.acquire(self._key, self._torch_timeout)
        with self._pools._cond:
            self._pools.tasks += 1
        try:
            results = group.run(payload, describe_fn(fn), timeout)
        except BaseException:
            with self._pools._cond:
                self._pools.failed += 1
            group.kill()
            raise
        self._pools.release(self._key, group)
        return results
