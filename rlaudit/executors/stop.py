"""Stopping a replay that runs in one of this process's threads: at a Ctrl-C, or when its
scenario's ``--timeout`` is spent.

A replay in this process (the reference backend's, outside a warm pool) is Python driving torch
on the executor's job or backend thread, and nothing in it looks for a request to stop; a thread
waiting on a warm pool's ranks polls them every 50 ms. :class:`Stoppers` raises :class:`Stopped`
in such a thread (CPython's ``PyThreadState_SetAsyncExc``): it arrives at the thread's next
Python instruction, milliseconds later even in a replay, and unwinds the replay through its
``with`` and ``finally`` blocks (a warm pool kills its busy group on the way out:
rlaudit/backends/launch/pool.py). ``Stopped`` derives from BaseException so that the engine's
``except Exception`` (a crashed backend is a finding) does not take it for one.

    stoppers = Stoppers()
    with stoppers.running("kl_k1"):         # in the thread that replays
        backend.replay(request)
    stoppers.stop("kl_k1")                  # from any other thread: that replay raises Stopped
    stoppers.stop()                         # every replay registered
"""

from __future__ import annotations

import contextlib
import ctypes
import threading
import time
from typing import Iterator

#: how long a Ctrl-C waits for the stopped threads to unwind before reporting regardless (a
#: thread inside one long C call takes the exception only when it returns)
UNWIND_WAIT_S = 10.0


class Stopped(BaseException):
    """Raised inside a thread whose replay was stopped (see the module docstring)."""


class Stoppers:
    """Threads running a stoppable replay, by key (a scenario's name); thread-safe."""

    def __init__(self):
        self._lock = threading.Lock()
        self._threads: dict[int, str] = {}   # thread ident -> key, while it replays
        self._stopped: set[int] = set()      # idents already sent Stopped (once each)

    @contextlib.contextmanager
    def running(self, key: str) -> Iterator[None]:
        """The calling thread replays for ``key`` inside the block: :meth:`stop` reaches it."""
        ident = threading.get_ident()
        with self._lock:
            self._threads[ident] = key
            self._stopped.discard(ident)
        try:
            yield
        finally:
            with self._lock:
                self._threads.pop(ident, None)

    def busy(self) -> int:
        """How many threads are inside :meth:`running` blocks now."""
        with self._lock:
            return len(self._threads)

    def stop(self, key: str | None = None) -> int:
        """Raise :class:`Stopped` in every thread replaying for ``key`` (None: every key), once
        per thread and block; how many were sent it."""
        sent = 0
        with self._lock:  # a thread leaving its block waits here: it is sent Stopped inside it
            for ident, k in self._threads.items():
                if (key is None or k == key) and ident not in self._stopped:
                    if raise_in_thread(ident, Stopped):
                        self._stopped.add(ident)
                        sent += 1
        return sent

    def wait_idle(self, seconds: float = UNWIND_WAIT_S) -> bool:
        """Wait up to ``seconds`` for every registered thread to leave its block; whether all
        did."""
        until = time.monotonic() + seconds
        while self.busy() and time.monotonic() < until:
            time.sleep(0.02)
        return not self.busy()


def raise_in_thread(ident: int, exc_type: type[BaseException]) -> bool:
    """Make ``exc_type`` raise in the thread ``ident`` at its next Python instruction; False when
    there is no such thread."""
    n = ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(ident),
                                                   ctypes.py_object(exc_type))
    if n > 1:  # cannot happen for one ident; undo rather than hit several threads
        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(ident), None)
        return False
    return n == 1
