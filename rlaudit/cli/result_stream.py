"""``--json``: stdout carries the JSON and nothing else, whatever the code under audit prints.

A trainer under audit prints where it likes (TRL prints its log dicts, a peer's C extension may
write to file descriptor 1). With ``--json`` everything printed while the run goes on is sent to
stderr, Python's ``print`` and writes to descriptor 1 alike, and only the result is written to
the real stdout:

    with result_stream(args.json) as out:
        results = run(...)                  # prints land on stderr
        json.dump(results, out)             # the only bytes on stdout
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
from typing import Iterator, TextIO


@contextlib.contextmanager
def result_stream(json_only: bool) -> Iterator[TextIO]:
    """Yield the stream the result goes to; with ``json_only``, stdout is stderr meanwhile.

    When ``sys.stdout`` is file descriptor 1 (a terminal, a pipe, a file), descriptor 1 itself
    is pointed at stderr for the block and the result written to a duplicate of the original;
    when it is something else (a test's captured stream), only ``sys.stdout`` is swapped."""
    if not json_only:
        yield sys.stdout
        return
    real = sys.stdout
    try:
        on_fd1 = real.fileno() == 1
    except (AttributeError, OSError, ValueError, io.UnsupportedOperation):
        on_fd1 = False
    if not on_fd1:
        with contextlib.redirect_stdout(sys.stderr):
            yield real
        return
    real.flush()
    saved = os.dup(1)
    out = os.fdopen(os.dup(saved), "w", encoding=getattr(real, "encoding", None) or "utf-8")
    os.dup2(2, 1)
    try:
        with contextlib.redirect_stdout(sys.stderr):
            yield out
    finally:
        sys.stderr.flush()
        out.flush()
        os.dup2(saved, 1)
        os.close(saved)
        out.close()
