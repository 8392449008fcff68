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

``RLAUDIT_START_METHOD=spawn`` spawns CPU pools too (to rule the forkserver out when debugging);
the one-shot :func:`~rlaudit.backends.launch.launch` always spawns.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import threading

from rlaudit.errors import InputError

START_METHODS = ("forkserver", "spawn")
PRELOAD_MODULE = "rlaudit.backends.launch._preload"
_ENV = "RLAUDIT_START_METHOD"
_ACTIVE_ENV = "RLAUDIT_PRELOAD_ACTIVE"  # read by _preload
_lock = threading.Lock()


def start_method(device: str) -> str:
    """``forkserver`` for CPU ranks, ``spawn`` for CUDA ranks or when ``$RLAUDIT_START_METHOD``
    says ``spawn``."""
    chosen = os.environ.get(_ENV, "").strip() or None
    if chosen is not None and chosen not in START_METHODS:
        raise InputError(f"expected one of {', '.join(START_METHODS)}, got {chosen!r}",
                         source="environment", key=_ENV)
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
    from multiprocessing import forkserver

    with _lock:
        server = forkserver._forkserver
        # only the preload: multiprocessing's default also re-imports the parent's __main__ in
        # the forkserver, which would run a user's unguarded script a second time (the
        # launcher hides __main__ from spawned ranks for the same reason: _no_main_reimport)
        server.set_forkserver_preload([PRELOAD_MODULE])
        # the forkserver inherits the environment when it starts: the switch that makes
        # _preload do its work (and only there) is set for that moment only
        saved = os.environ.get(_ACTIVE_ENV)
        os.environ[_ACTIVE_ENV] = "1"
        try:
            server.ensure_running()  # returns at once if its server is alive
        finally:
            if saved is None:
                os.environ.pop(_ACTIVE_ENV, None)
            else:
                os.environ[_ACTIVE_ENV] = saved


def forkserver_pid() -> int | None:
    """The pid of this process's forkserver, if one was started."""
    from multiprocessing import forkserver

    return forkserver._forkserver._forkserver_pid


def stop_forkserver() -> None:
    """Stop this process's forkserver, if it runs; the next :func:`ensure_forkserver` starts a
    new one. Only once every pool forked from it is closed: a forked process's exit status
    reaches its launcher through the forkserver, so with the forkserver gone a live rank reads
    as dead (exit code 255). Otherwise the forkserver leaves by itself with this process."""
    import signal
    from multiprocessing import forkserver

    with _lock:
        server = forkserver._forkserver
        pid = server._forkserver_pid
        if pid is None:
            return
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
