"""How the ranks of a warm pool are started: forked from a preloaded forkserver on CPU, spawned on
CUDA.

A spawned rank is a fresh interpreter that imports torch, transformers and megatron-core itself
(4-5 CPU-seconds each; a scenario's FSDP and Megatron groups have four ranks). On CPU the pools
instead fork their ranks from multiprocessing's *forkserver*, started once per process with
``_preload`` as its preload module: the imports are paid once, in the background, from the moment
:func:`ensure_forkserver` is called (``rlaudit run`` calls it before it even loads the scenarios),
and each rank starts with them loaded. The forkserver holds no thread pool, no tensor and no CUDA
context (``_preload`` only imports), so a forked rank is in the same state as a spawned one that
has imported the same modules; the pool isolation test compares both start methods bit for bit.

CUDA pools are always spawned: a process forked from a parent that has initialised the CUDA driver
cannot use CUDA, and on a GPU machine the import cost is a small share of a run.

``RLAUDIT_START_METHOD=spawn`` spawns CPU pools too (to rule the forkserver out when debugging).

The one-shot :func:`~rlaudit.backends.launch.launch` forks its CPU ranks from the same forkserver
(:func:`one_shot_context`) when a forked rank would see what a spawned one sees: no ``env`` of its
own (those variables are promised to be set before torch is imported) and the launcher's
environment as it was when the forkserver started (a spawned rank inherits the launcher's current
environment; a forked one, the forkserver's). Otherwise it spawns. A multi-rank test session
launches dozens of one-shot groups: each spawned rank imported torch (1.2 CPU-s), and transformers
and megatron-core too when its function needed them (4-5 CPU-s).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import threading
from multiprocessing import forkserver, popen_forkserver

from rlaudit import switches

PRELOAD_MODULE = "rlaudit.backends.launch.preload"
#: set by pytest for each test phase; no rank reads it, and it would never match
_VOLATILE_ENV = frozenset({"PYTEST_CURRENT_TEST"})
_lock = threading.Lock()
#: the environment this process's running forkserver started with (None: not started by
#: ensure_forkserver, or stopped)
_server_env: dict[str, str] | None = None


def start_method(device: str) -> str:
    """``forkserver`` for CPU ranks, ``spawn`` for CUDA ranks or when ``$RLAUDIT_START_METHOD``
    says ``spawn``."""
    chosen = switches.start_method()
    if device != "cpu":
        return "spawn"
    return chosen or "forkserver"


def context(device: str):
    """The multiprocessing context warm-pool ranks on ``device`` start from."""
    method = start_method(device)
    if method == "forkserver":
        ensure_forkserver()
    return mp.get_context(method)


def ensure_forkserver() -> None:
    """Start this process's forkserver with the preload, unless it runs already (a dead one is
    started again). Returns at once: the preload's imports run in the forkserver, and the first
    rank forked from it waits for them."""
    global _server_env
    with _lock:
        server = forkserver._forkserver
        before = server._forkserver_pid
        # only the preload: multiprocessing's default also re-imports the parent's __main__ in
        # the forkserver, which would run a user's unguarded script a second time (the
        # launcher hides __main__ from spawned ranks for the same reason: no_main_reimport)
        server.set_forkserver_preload([PRELOAD_MODULE])
        # the forkserver inherits the environment when it starts: the switch that makes
        # preload.py do its work (and only there) is set for that moment only
        saved = os.environ.get(switches.PRELOAD_ACTIVE)
        os.environ[switches.PRELOAD_ACTIVE] = "1"
        try:
            server.ensure_running()  # returns at once if its server is alive
        finally:
            if saved is None:
                os.environ.pop(switches.PRELOAD_ACTIVE, None)
            else:
                os.environ[switches.PRELOAD_ACTIVE] = saved
        if server._forkserver_pid != before:  # started just now, with this environment (one
            _server_env = _comparable_env()     # started elsewhere keeps None: not known)


def _comparable_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in _VOLATILE_ENV}


def one_shot_context(device: str, env) -> "mp.context.BaseContext":
    """The context a one-shot launch starts its ranks from: the preloaded forkserver on CPU when a
    forked rank sees what a spawned one would (no ``env`` of the launch's own, the launcher's
    environment unchanged since the forkserver started), else spawn."""
    if env or start_method(device) == "spawn":
        return mp.get_context("spawn")
    ensure_forkserver()
    with _lock:
        same = _server_env is not None and _server_env == _comparable_env()
    return mp.get_context("forkserver" if same else "spawn")


def forkserver_pid() -> int | None:
    """The pid of this process's forkserver, if one was started."""
    return forkserver._forkserver._forkserver_pid


def _forked_processes_alive() -> bool:
    """Whether a child this process started through its forkserver still runs."""
    return any(isinstance(getattr(p, "_popen", None), popen_forkserver.Popen)
               for p in mp.active_children())


def stop_forkserver() -> None:
    """Stop this process's forkserver, if it runs and no process this one started through it
    (a warm pool's rank, a one-shot launch's) still runs: a forked process's exit status
    reaches its launcher through the forkserver, so with the forkserver gone a live rank reads
    as dead (exit code 255). The next :func:`ensure_forkserver` starts a new one. Otherwise the
    forkserver leaves by itself with this process."""
    global _server_env
    with _lock:
        server = forkserver._forkserver
        pid = server._forkserver_pid
        if pid is None or _forked_processes_alive():
            return
        _server_env = None
        try:
            os.kill(pid, signal.SIGKILL)  # it may be inside the preload's imports: no handshake
            os.waitpid(pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass
        # what ensure_running() itself resets when it finds its server dead
        os.close(server._forkserver_alive_fd)
        server._forkserver_address = None
        server._forkserver_alive_fd = None
        server._forkserver_pid = None
