"""How ranks that did not return a result are described: one :class:`RankOutcome` per such rank,
ordered causes first, and the text of the :class:`~rlaudit.errors.RankFailure` built from them.

Pure functions of the per-rank files (see :class:`~rlaudit.backends.launch.common.RankFiles`) and
exit codes; no processes are touched here.
"""

from __future__ import annotations

import json
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from rlaudit.backends.launch.common import RankFiles

#: Lines of a rank's log quoted in a report: a traceback printed by the rank plus some context.
LOG_TAIL_LINES = 40
#: Characters of a rank's stack dump quoted in a report (gloo adds idle threads; the main thread
#: comes last in faulthandler's dump, so the tail is what matters).
STACKS_MAX_CHARS = 6000

#: Shown instead of a log when a process ended before the rank code started (spawn bootstrap).
_NO_LOG = ("(no log: the process ended while being spawned, before the rank started; "
           "multiprocessing printed its error on the launcher's stderr)")

Kind = Literal["raised", "died", "timeout", "terminated"]


@dataclass(frozen=True)
class RankOutcome:
    """How one rank ended without returning a result.

    ``kind``:
    - ``raised``: the rank caught an exception (``exc_type``, ``message``, ``traceback``;
      ``phase`` is import, init, fn or result -- the last meaning its return value would not save);
    - ``died``: the process ended without a record (``os._exit``, a signal, a segfault);
      ``exitcode`` < 0 is ``-signal``;
    - ``timeout``: still running at the deadline; ``terminated``: still running when another rank
      failed. Both were killed by the launcher; ``phase`` is ``startup`` (spawn, imports,
      rendezvous) or ``fn``, and ``stacks`` holds the Python stacks dumped just before.
    ``when``: wall-clock seconds (``time.time``) when the exception was caught or the launcher saw
    the exit. ``peer_lost``: the exception looks like the echo of another rank vanishing from a
    collective, so it is listed after the causes.
    """

    rank: int
    kind: Kind
    when: float
    exitcode: int | None = None
    phase: str | None = None
    exc_type: str | None = None
    message: str | None = None
    traceback: str | None = None
    peer_lost: bool = False
    log_tail: str = ""
    stacks: str = ""

    def headline(self) -> str:
        """One line: what happened to this rank."""
        if self.kind == "raised":
            first_line = (self.message or "").strip().split("\n", 1)[0]
            line = f"rank {self.rank} raised {_short_type(self.exc_type)}: {first_line}"
            line += f" (phase: {self.phase})"
            if self.peer_lost:
                line += " -- likely a consequence of another rank leaving the collective"
            return line
        if self.kind == "died":
            return f"rank {self.rank} {describe_exitcode(self.exitcode)}"
        where = "still starting" if self.phase == "startup" else "still running fn"
        if self.kind == "timeout":
            return f"rank {self.rank} was {where} at the deadline and was killed"
        return f"rank {self.rank} was {where} and was terminated by the launcher"

    def details(self) -> str:
        """The headline followed by the traceback, the stack dump and the log tail we have."""
        parts = [f"=== {self.headline()} ==="]
        if self.traceback:
            parts.append(self.traceback.rstrip())
        if self.stacks:
            parts.append(f"--- rank {self.rank} Python stacks when killed ---\n"
                         f"{self.stacks.rstrip()}")
        if self.log_tail:
            parts.append(f"--- rank {self.rank} log (last {LOG_TAIL_LINES} lines) ---\n"
                         f"{self.log_tail.rstrip()}")
        return "\n".join(parts)


def describe_exitcode(code: int | None) -> str:
    """``'died with exit code 7'``, ``'was killed by signal SIGKILL (9)'``, ..."""
    if code is None:
        return "did not exit"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = "unknown signal"
        return f"was killed by signal {name} ({-code})"
    if code == 0:
        return "exited with code 0 without returning a result"
    return f"died with exit code {code}"


def read_error(files: RankFiles) -> dict | None:
    """The rank's error record, or None when it wrote none (or it is unreadable)."""
    try:
        return json.loads(files.error.read_text())
    except (OSError, ValueError):
        return None


def read_tail(path: Path, max_lines: int = LOG_TAIL_LINES, max_chars: int | None = None) -> str:
    """The last ``max_lines`` lines (then at most ``max_chars`` characters) of a text file; ''
    when the file is missing."""
    try:
        text = path.read_bytes().decode("utf-8", errors="replace")
    except OSError:
        return ""
    text = "\n".join(text.splitlines()[-max_lines:])
    if max_chars is not None and len(text) > max_chars:
        text = "...\n" + text[-max_chars:]
    return text


def exited_outcome(rank: int, exitcode: int, seen_at: float, files: RankFiles) -> RankOutcome:
    """The outcome of a rank that exited without a result: from its error record if it wrote one
    (``raised``), else from its exit code (``died``; ``seen_at`` is when the launcher saw it)."""
    record = read_error(files)
    tail = read_tail(files.log) if files.log.exists() else _NO_LOG
    if record is None or record.get("phase") == "teardown":
        return RankOutcome(rank, "died", seen_at, exitcode=exitcode, log_tail=tail)
    return RankOutcome(rank, "raised", float(record["time"]), exitcode=exitcode,
                       phase=record["phase"], exc_type=record["type"], message=record["message"],
                       traceback=record["traceback"], peer_lost=bool(record["peer_lost"]),
                       log_tail=tail)


def killed_outcome(rank: int, kind: Kind, seen_at: float, files: RankFiles) -> RankOutcome:
    """The outcome of a rank the launcher killed (``timeout``/``terminated``), with its stacks."""
    phase = "fn" if files.ready.exists() else "startup"
    return RankOutcome(rank, kind, seen_at, phase=phase, log_tail=read_tail(files.log),
                       stacks=read_tail(files.stacks, 10**6, STACKS_MAX_CHARS))


def order_outcomes(outcomes: list[RankOutcome]) -> list[RankOutcome]:
    """Causes first: ranks that raised or died, by time; then echoes of a lost peer, by time; then
    ranks that timed out, then ranks terminated because of the others, each by rank."""
    kind_rank = {"raised": 0, "died": 0, "timeout": 1, "terminated": 2}

    def key(o: RankOutcome) -> tuple:
        when = o.when if o.kind in ("raised", "died") else 0.0
        return kind_rank[o.kind], o.peer_lost, when, o.rank

    return sorted(outcomes, key=key)


def failure_message(outcomes: list[RankOutcome], *, fn_name: str, world_size: int,
                    timeout: float, startup_timeout: float) -> str:
    """The text of the RankFailure: a summary line per rank, then each rank's details.

    ``timeout``/``startup_timeout``: the seconds ``fn`` / startup were allowed (for timeouts)."""
    ordered = order_outcomes(outcomes)
    failed = [o for o in ordered if o.kind in ("raised", "died")]
    stuck = [o for o in ordered if o.kind == "timeout"]
    if failed:
        first = failed[0]
        head = (f"rank {first.rank} of {world_size} failed running {fn_name}: "
                f"{first.headline().removeprefix(f'rank {first.rank} ')}")
    else:
        in_fn = [o.rank for o in stuck if o.phase == "fn"]
        starting = [o.rank for o in stuck if o.phase != "fn"]
        what = []
        if in_fn:
            what.append(f"ranks not finished: {_ranks(in_fn)}")
        if starting:
            what.append(f"ranks not started within {startup_timeout:g} s: {_ranks(starting)}")
        limit = f"after {timeout:g} s " if in_fn else ""
        head = f"timed out {limit}running {fn_name} on {world_size} ranks; {'; '.join(what)}"
    lines = [head, "ranks, first failure first:"]
    lines += [f"  {o.headline()}" for o in ordered]
    body = "\n\n".join(o.details() for o in ordered)
    return "\n".join(lines) + "\n\n" + body


def teardown_note(rank: int, exitcode: int, files: RankFiles) -> str:
    """A line for the warning about a rank that crashed after its result was complete."""
    record = read_error(files)
    if record is not None and record.get("phase") == "teardown":
        what = f"raised {_short_type(record['type'])}: {record['message']}"
    else:
        what = describe_exitcode(exitcode)
    return f"rank {rank} {what} after its result was complete (during barrier/destroy or exit)"


def _ranks(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks))


def _short_type(qualified: str | None) -> str:
    """``builtins.ValueError`` -> ``ValueError``; other modules stay qualified."""
    if qualified is None:
        return "<unknown>"
    return qualified.removeprefix("builtins.")
