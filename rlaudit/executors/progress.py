"""The progress of ``rlaudit run``: done/total scenario x backend jobs, the job(s) running, elapsed
time and an estimate of the time left.

On a terminal it is one status line on stderr, redrawn in place every second::

    [ 12/75] kl_k1 · fsdp   elapsed 2:31   left ~5:12

Elsewhere (CI logs, a pipe) it degrades to one plain line per finished job::

    [12/75] kl_k1 fsdp: 3.2 s (elapsed 2:31, left ~5:12)

The estimate is the mean time of the finished jobs times the jobs left, divided by how many run
at once (``parallel``); it reads ``--`` until a job has finished.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from typing import Iterator, TextIO

#: Seconds between redraws of the terminal line (the elapsed time ticks).
REDRAW_S = 1.0


def clock(seconds: float | None) -> str:
    """``75.2 -> '1:15'``, ``3725 -> '1:02:05'``, None -> ``'--'``."""
    if seconds is None:
        return "--"
    s = int(round(seconds))
    h, rest = divmod(s, 3600)
    m, s = divmod(rest, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


class Progress:
    """Counts jobs and shows them (see the module docstring). Thread-safe: the Ray executor
    reports from several threads."""

    def __init__(self, total: int, *, stream: TextIO | None = None, enabled: bool = True,
                 live: bool | None = None, parallel: int = 1, now=time.monotonic):
        self.total, self.done = total, 0
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = enabled
        self.live = (enabled and _isatty(self.stream)) if live is None else (enabled and live)
        self.parallel = max(1, parallel)
        self._now = now
        self._t0 = now()
        self._busy = 0.0
        self._running: dict[tuple[str, str], float] = {}
        self._lock = threading.RLock()
        self._drawn = False
        self._paused = 0
        self._stop = threading.Event()
        self._ticker = None
        if self.live:
            self._ticker = threading.Thread(target=self._tick, daemon=True,
                                            name="rlaudit-progress")
            self._ticker.start()

    # ---- what the executors call -------------------------------------------------------------

    def start(self, scenario: str, backend: str) -> None:
        with self._lock:
            self._running[(scenario, backend)] = self._now()
            self._draw()

    def finish(self, scenario: str, backend: str) -> None:
        with self._lock:
            started = self._running.pop((scenario, backend), self._now())
            seconds = self._now() - started
            self.done += 1
            self._busy += seconds
            if self.live:
                self._draw()
            elif self.enabled:
                self.stream.write(f"[{self.done}/{self.total}] {scenario} {backend}: "
                                  f"{seconds:.1f} s (elapsed {clock(self.elapsed)}, "
                                  f"left ~{clock(self.remaining)})\n")
                self.stream.flush()

    @property
    def elapsed(self) -> float:
        return self._now() - self._t0

    @property
    def remaining(self) -> float | None:
        if not self.done:
            return None
        return self._busy / self.done * (self.total - self.done) / self.parallel

    def line(self) -> str:
        """The terminal status line (without control characters)."""
        with self._lock:
            width = len(str(self.total))
            head = f"[{self.done:>{width}}/{self.total}]"
            if self._running:
                (scenario, backend), _ = max(self._running.items(), key=lambda kv: kv[1])
                more = f" (+{len(self._running) - 1})" if len(self._running) > 1 else ""
                current = f" {scenario} · {backend}{more}"
            else:
                current = ""
            return (f"{head}{current}   elapsed {clock(self.elapsed)}   "
                    f"left ~{clock(self.remaining)}")

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Clear the terminal line while the caller prints; redraw it afterwards."""
        with self._lock:
            self._paused += 1
            self._clear()
        try:
            yield
        finally:
            with self._lock:
                self._paused -= 1
                self._draw()

    def close(self) -> None:
        self._stop.set()
        with self._lock:
            self._clear()
            self.live = False

    # ---- drawing --------------------------------------------------------------------------------

    def _draw(self) -> None:
        if not self.live or self._paused:
            return
        self.stream.write("\r" + self.line() + "\x1b[K")
        self.stream.flush()
        self._drawn = True

    def _clear(self) -> None:
        if self._drawn:
            self.stream.write("\r\x1b[K")
            self.stream.flush()
            self._drawn = False

    def _tick(self) -> None:
        while not self._stop.wait(REDRAW_S):
            with self._lock:
                self._draw()


def _isatty(stream) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False
