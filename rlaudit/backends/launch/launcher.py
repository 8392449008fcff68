"""Run a function on ``world_size`` local ranks under torch.distributed; collect their results.

The FSDP and Megatron backends (and multi-rank tests) run their ranks through :func:`launch`::

    # mymodule.py -- fn must be importable: a module-level function, not a lambda or a closure
    import torch, torch.distributed as dist

    def check_allreduce(info, scale):
        x = torch.full((2,), float(info.rank + 1), device=info.device) * scale
        dist.all_reduce(x)                 # the default group is initialised already
        return {"rank": info.rank, "sum": x.cpu()}

    from rlaudit.backends.launch import launch
    out = launch(check_allreduce, 2, args=(10.0,))       # gloo on CPU
    out[1]["sum"]                                        # tensor([30., 30.])
    launch(check_allreduce, 2, args=(1.0,), device="cuda")   # nccl, cuda:<local_rank>

What a rank gets: the torchrun environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``LOCAL_WORLD_SIZE``, ``MASTER_ADDR`` = ``host``, ``MASTER_PORT``,
``TORCHELASTIC_USE_AGENT_STORE``), ``GLOO_SOCKET_IFNAME`` (and ``NCCL_SOCKET_IFNAME`` with NCCL)
naming the interface of ``host``, plus ``env``, all set before ``fn`` runs -- and before torch is
imported in the rank when ``env`` is given; ``OMP_NUM_THREADS`` and ``torch.set_num_threads`` =
``threads_per_rank``; an initialised default process group; on CUDA its device set to
``local_rank``; stdout/stderr (file descriptors, so C++ output too) in a log file.

**How ranks start** (``start.one_shot_context``): on CPU they are forked from this process's
forkserver, which has imported torch, transformers and megatron-core once (the warm pools fork
theirs from it too), whenever a forked rank sees what a spawned one would: no ``env`` of the
launch's own, and the launcher's environment as it was when the forkserver started. Otherwise --
``env`` given, the environment changed since, CUDA, or ``RLAUDIT_START_METHOD=spawn`` -- they are
spawned, and **spawning is expensive** (each rank imports torch: 3-5 s for two ranks on a small
CPU box). Either way, give ``fn`` many checks to run in one group and return all their results,
rather than launching once per check. The first launch in a process waits for the forkserver's
imports.

Design decisions:

- *Rendezvous*: the launcher hosts the TCP store itself, listening on ``host`` only (default
  127.0.0.1; torch's store alone would listen on every interface, unauthenticated: see
  ``_rendezvous``), on port 0 so the OS picks a free port that stays held for the whole launch:
  no bind-then-release race, so parallel pytest-xdist workers and concurrent launches in threads
  cannot collide, and no retry loop is needed. ``MASTER_PORT`` names that store and
  ``TORCHELASTIC_USE_AGENT_STORE=True`` tells any ``env://`` init inside a rank to connect to it
  as a client -- exactly torchrun's agent store.
- *Results* travel as files: each rank saves its return value (``torch.save``) to a temporary
  file and renames it into place (atomic), *before* ``barrier()``/``destroy_process_group()``.
  A queue was rejected: a process killed after ``put`` can lose data still in the feeder
  thread, and a large unread item blocks the rank from exiting. With files, a rank that crashes
  in teardown (gloo sometimes aborts at exit) has still delivered its result; the launcher then
  returns the results and emits :class:`RankTeardownWarning` ("crash after results complete"),
  whereas a rank that dies before its result is complete raises
  :class:`~rlaudit.errors.RankFailure`. Results are loaded
  onto the CPU (``map_location="cpu"``) with full unpickling: they come from our own ranks.
- *Failures* (docs/findings.md, seeds: a rank raising inside forward/backward desynchronised the
  collective and every rank died with no traceback): a rank that raises records the traceback and
  exits at once, without entering another collective; the launcher watches every rank at once,
  and after the first failure (plus a 1 s grace for other ranks' own errors) dumps the survivors'
  Python stacks and kills their process groups. :class:`~rlaudit.errors.RankFailure` lists every
  rank, causes first (a rank whose error is merely "peer connection closed" comes after the rank
  that left), with tracebacks, exit codes/signals, stack dumps and log tails; its ``outcomes``
  attribute holds them as :class:`RankOutcome` records. A timeout does the same and names the
  ranks that had not finished, with their stacks (faulthandler, on SIGUSR1). ``timeout`` counts
  from when every rank has joined the group; starting the ranks has its own generous bound
  (``rank_group.STARTUP_TIMEOUT_S``), so a slow spawn on a loaded CI box does not eat ``fn``'s time.
  No rank outlives :func:`launch`: ranks lead their own process group, which the launcher kills,
  and kill it themselves if the launcher disappears.

Ranks leave with ``os._exit`` after flushing (so ``atexit`` handlers do not run in a rank).
Arguments and ``fn`` are pickled by the launcher (pass CPU tensors); ``fn`` must be importable
by a process that has not imported it (a spawned rank, or one forked from the forkserver) -- a
lambda or a function defined inside another function or a test raises
:class:`~rlaudit.errors.InputError` naming ``fn``.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import shutil
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any, Callable, Mapping

# the modules by their own names, not through this package's face (which imports this module):
# STARTUP_TIMEOUT_S and friends are read at call time, so tests may set them
import rlaudit.backends.launch.rank_group as rank_group
import rlaudit.backends.launch.rendezvous as rendezvous
import rlaudit.backends.launch.start as start
from rlaudit.backends.launch.common import MASTER_ADDR, RankSpec, scratch_dir
from rlaudit.backends.launch.outcomes import failure_message, order_outcomes, teardown_note
from rlaudit.backends.launch.rank_group import RankGroup
from rlaudit.errors import InputError, RankFailure

#: Variables the launcher sets in every rank; ``env`` may not override them.
RESERVED_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                "MASTER_PORT", "TORCHELASTIC_USE_AGENT_STORE", "OMP_NUM_THREADS",
                "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
_DEVICES = ("cpu", "cuda")
_BACKENDS = ("gloo", "nccl")
_SOURCE = "launch()"


class RankTeardownWarning(RuntimeWarning):
    """Every rank's result was complete, but some rank crashed or hung while tearing down."""


def launch(fn: Callable[..., Any], world_size: int, *, args: tuple = (),
           kwargs: Mapping[str, Any] | None = None, backend: str | None = None,
           device: str = "cpu", timeout: float = 300.0, env: Mapping[str, str] | None = None,
           threads_per_rank: int = 1, host: str = MASTER_ADDR) -> list[Any]:
    """Run ``fn(info, *args, **kwargs)`` in ``world_size`` fresh processes; return their results.

    ``fn``: an importable (module-level) callable; ``info`` is the rank's :class:`RankInfo`.
    ``backend``: ``gloo`` or ``nccl``; default ``nccl`` on ``device="cuda"``, else ``gloo``.
    ``device``: ``cpu`` or ``cuda`` (rank r uses ``cuda:r``). ``timeout``: seconds ``fn`` may
    run, counted from when every rank has joined the process group (starting the ranks has its own
    bound, ``rank_group.STARTUP_TIMEOUT_S``, since a loaded machine may take tens of seconds to
    spawn).
    ``env``: extra environment variables for each rank (not :data:`RESERVED_ENV`), set before
    torch is imported (the ranks are then spawned, never forked: see the module docstring).
    ``host``: the address the rendezvous store and the ranks' gloo/NCCL sockets listen on; the
    default, loopback, is right for every local launch. A multi-node setup passes this node's
    address on the interface the other nodes reach; a wildcard (``0.0.0.0``) is refused.

    Returns the ranks' return values in rank order, loaded onto the CPU.
    Raises :class:`~rlaudit.errors.RankFailure` if any rank raised, died or was still running at
    the deadline (see the module docstring); :class:`~rlaudit.errors.InputError` for bad arguments.
    """
    backend = check_arguments(world_size, backend, device, timeout, threads_per_rank)
    addr = rendezvous.check_host(host)
    rank_env = {**check_env(env), **rendezvous.rank_socket_env(addr, backend=backend)}
    payload = pickle_payload(fn, args, kwargs)
    fn_name = describe_fn(fn)

    import torch  # lazy: rank processes import this module before torch (env first)

    root = Path(tempfile.mkdtemp(prefix="rlaudit-launch-"))
    store = None
    try:
        scratch_dir(root).mkdir()
        # the launcher enforces `timeout`; torch's own clocks only need to outlast startup
        torch_timeout = max(timeout, rank_group.STARTUP_TIMEOUT_S)
        store = host_store(torch_timeout, addr)
        specs = [rank_spec(r, world_size, device, backend, root, store.port, torch_timeout,
                       threads_per_rank, rank_env, addr) for r in range(world_size)]
        ctx = start.one_shot_context(device, env)  # CPU: forked from the preloaded forkserver
        group = RankGroup(specs, payload, ctx=ctx)
        try:
            with no_main_reimport(fn):
                group.start()
            group.stop(group.supervise(timeout))
        finally:
            group.kill_all()
        outcomes = order_outcomes(group.outcomes())
        if outcomes:
            exc = RankFailure(failure_message(outcomes, fn_name=fn_name, world_size=world_size,
                                              timeout=timeout,
                                              startup_timeout=rank_group.STARTUP_TIMEOUT_S))
            exc.outcomes = outcomes  # causes first, as in the message
            raise exc
        warn_teardown(group)
        return [torch.load(f.result, map_location="cpu", weights_only=False) for f in group.files]
    finally:
        del store  # closes the rendezvous port
        shutil.rmtree(root, ignore_errors=True)


def host_store(timeout_s: float, addr: str = MASTER_ADDR):
    """The rendezvous store a group's ranks join (``MASTER_PORT``): hosted by the launcher (or a
    warm pool), listening on ``addr`` only (never every interface: see ``_rendezvous``), port 0
    so the OS picks a free one that stays held while the store lives."""
    return rendezvous.rendezvous_store(addr, timeout=timeout_s)


def rank_spec(rank: int, world_size: int, device: str, backend: str, root: Path, port: int,
          timeout: float, threads: int, env: dict[str, str], addr: str = MASTER_ADDR) -> RankSpec:
    torchrun = {"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank),
                "LOCAL_WORLD_SIZE": str(world_size), "MASTER_ADDR": addr,
                "MASTER_PORT": str(port), "TORCHELASTIC_USE_AGENT_STORE": "True",
                "OMP_NUM_THREADS": str(threads)}
    return RankSpec(rank=rank, world_size=world_size, local_rank=rank, device_type=device,
                    backend=backend, root=root, master_port=port, timeout_s=timeout,
                    threads=threads, parent_pid=os.getpid(), env={**env, **torchrun},
                    master_addr=addr)


def warn_teardown(group: RankGroup) -> None:
    notes = []
    for r, f in enumerate(group.files):
        if group.killed.get(r) == "teardown":
            notes.append(f"rank {r} was still tearing down (barrier/destroy) and was killed")
        elif group.exitcodes.get(r, 0) != 0:
            notes.append(teardown_note(r, group.exitcodes[r], f))
    if notes:
        warnings.warn("all results were complete, but: " + "; ".join(notes),
                      RankTeardownWarning, stacklevel=3)


def check_arguments(world_size: object, backend: str | None, device: str, timeout: float,
                     threads_per_rank: object) -> str:
    """Validate the scalar arguments; return the backend to use."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise InputError(f"expected an int >= 1, got {world_size!r}", source=_SOURCE,
                         key="world_size")
    if isinstance(threads_per_rank, bool) or not isinstance(threads_per_rank, int) \
            or threads_per_rank < 1:
        raise InputError(f"expected an int >= 1, got {threads_per_rank!r}", source=_SOURCE,
                         key="threads_per_rank")
    if not isinstance(timeout, (int, float)) or not timeout > 0:
        raise InputError(f"expected seconds > 0, got {timeout!r}", source=_SOURCE, key="timeout")
    if device not in _DEVICES:
        raise InputError(f"expected one of {', '.join(_DEVICES)} (rank r uses cuda:r), "
                         f"got {device!r}", source=_SOURCE, key="device")
    backend = backend if backend is not None else ("nccl" if device == "cuda" else "gloo")
    if backend not in _BACKENDS:
        raise InputError(f"expected one of {', '.join(_BACKENDS)}, got {backend!r}",
                         source=_SOURCE, key="backend")
    if backend == "nccl" and device != "cuda":
        raise InputError("nccl needs device='cuda'", source=_SOURCE, key="backend")
    if device == "cuda":
        import torch  # lazy: rank processes import this module before torch (env first)

        available = torch.cuda.device_count()
        if available < world_size:
            raise InputError(f"{world_size} ranks need {world_size} CUDA devices, "
                             f"{available} visible", source=_SOURCE, key="world_size")
    return backend


def check_env(env: Mapping[str, str] | None) -> dict[str, str]:
    out = dict(env or {})
    for k, v in out.items():
        if not isinstance(k, str) or not isinstance(v, str):
            raise InputError(f"keys and values must be str, got {k!r}: {v!r}", source=_SOURCE,
                             key="env")
        if k in RESERVED_ENV:
            raise InputError(f"{k} is set by the launcher (reserved: {', '.join(RESERVED_ENV)}; "
                             "use threads_per_rank for OMP_NUM_THREADS)", source=_SOURCE,
                             key=f"env.{k}")
    return out


@contextlib.contextmanager
def no_main_reimport(fn):
    """Spawn re-imports the parent's ``__main__`` in every rank (running an unguarded script a
    second time, failing outright for ``python -`` or a notebook). When ``fn`` lives in a real
    module the ranks do not need ``__main__`` at all: hide it from multiprocessing while the
    ranks start, so library callers need no ``if __name__ == "__main__"`` guard."""
    main = sys.modules.get("__main__")
    if main is None or getattr(fn, "__module__", None) == "__main__":
        yield
        return
    saved = {k: main.__dict__[k] for k in ("__file__", "__spec__") if k in main.__dict__}
    try:
        main.__dict__.pop("__file__", None)
        main.__spec__ = None
        yield
    finally:
        main.__dict__.pop("__spec__", None)
        main.__dict__.update(saved)


def pickle_payload(fn: Callable[..., Any], args: tuple, kwargs: Mapping[str, Any] | None) -> bytes:
    """Pickle ``(fn, args, kwargs)`` now, so that what a rank cannot receive fails here, clearly."""
    if not callable(fn):
        raise InputError(f"expected a callable, got {type(fn).__name__}", source=_SOURCE, key="fn")
    name = describe_fn(fn)
    qualname = getattr(fn, "__qualname__", "")
    if "<lambda>" in qualname or "<locals>" in qualname:
        raise InputError(f"{name} cannot run in a rank process: a lambda or a function defined "
                         "inside another function (or test) cannot be imported by a fresh "
                         "process; define it at module level", source=_SOURCE, key="fn")
    main = sys.modules.get("__main__")
    main_file = getattr(main, "__file__", None)
    if getattr(fn, "__module__", None) == "__main__" and main_file is None:
        raise InputError(f"{name} is defined in an interactive session, which a rank process "
                         "cannot import; put it in a module", source=_SOURCE, key="fn")
    if getattr(fn, "__module__", None) == "__main__" and main_file is not None \
            and getattr(main, "__spec__", None) is None and not os.path.exists(main_file):
        # spawn re-runs the main script in every rank and would fail on e.g. '<stdin>'
        raise InputError(f"the main script {main_file!r} is not a file, so spawned ranks cannot "
                         "start; run the launching code from a file, a module or pytest",
                         source=_SOURCE, key="fn")
    if not isinstance(args, (tuple, list)):
        raise InputError(f"expected a tuple, got {type(args).__name__}", source=_SOURCE, key="args")
    args = tuple(args)
    kwargs = dict(kwargs or {})
    for key, value in (("fn", fn), ("args", args), ("kwargs", kwargs)):
        try:
            pickle.dumps(value)
        except Exception as exc:  # noqa: BLE001 - pickling raises many types
            raise InputError(f"cannot be pickled for a rank process ({type(exc).__name__}: "
                             f"{exc}); fn must be module-level, arguments plain data or CPU "
                             "tensors", source=_SOURCE, key=key) from exc
    return pickle.dumps((fn, args, kwargs))


def describe_fn(fn: Callable[..., Any]) -> str:
    module = getattr(fn, "__module__", None)
    qualname = getattr(fn, "__qualname__", None)
    return f"{module}.{qualname}" if module and qualname else repr(fn)
