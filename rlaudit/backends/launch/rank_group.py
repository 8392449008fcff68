"""The rank processes of one launch, and the supervision loop that watches them.

The launcher never waits on one rank blindly: it waits on *every* rank's exit sentinel at once,
with a short period to look at the ready/result files, so that the first rank to fail is seen at
once however the others are blocked. What it then does is decided by these clocks:

- a rank exited without a result: give the others :data:`FAILURE_GRACE_S` to report failures of
  their own, then dump their stacks and kill them;
- every result is complete: give teardown :data:`TEARDOWN_GRACE_S` (or :data:`FAILURE_GRACE_S` once
  a rank crashed in teardown), then kill the stragglers -- the results stand;
- startup (spawn, imports, rendezvous) took more than :data:`STARTUP_TIMEOUT_S`, or ``fn`` ran
  longer than the caller's timeout after every rank was ready: dump the unfinished ranks' stacks
  and kill them. Startup has its own clock so that a loaded machine, where spawning a few ranks
  can take tens of seconds, does not eat into the time given to ``fn``.

Killing is ``killpg(pid, SIGKILL)``: each rank leads its own process group, so whatever it started
(data loader workers, engine subprocesses) dies with it. A rank's group is killed *before* its
exit status is collected, while its pid cannot yet have been reused.
"""

from __future__ import annotations

import multiprocessing as mp
import multiprocessing.connection
import os
import signal
import time

from rlaudit.backends.launch.common import RankFiles, RankSpec
from rlaudit.backends.launch.outcomes import Kind, RankOutcome, exited_outcome, killed_outcome
from rlaudit.backends.launch.worker import rank_main

#: Bound on spawn + ``import torch`` + rendezvous, separate from ``fn``'s timeout: seconds on an
#: idle box, tens of seconds on an overloaded 2-core CI runner; only a hang takes longer.
STARTUP_TIMEOUT_S = 300.0
#: After the first rank fails, how long the others get to report their own failures before they
#: are killed: enough for ranks that fail independently at the same moment, short for the user.
FAILURE_GRACE_S = 1.0
#: After every result is complete, how long barrier/destroy/exit may take before the launcher
#: kills the stragglers (the results are returned, with a warning).
TEARDOWN_GRACE_S = 30.0
#: How long to wait for faulthandler's stack dumps after SIGUSR1 before SIGKILL.
STACK_DUMP_WAIT_S = 2.0
#: Supervision period: how late a new result file or an expired grace is noticed (an exit wakes
#: the loop at once).
_POLL_S = 0.05
#: How long to wait for a SIGKILLed process to be reaped (only a process stuck in the kernel
#: takes longer, and then we give up on it rather than hang).
_REAP_WAIT_S = 10.0


class RankGroup:
    """``world_size`` spawned processes running :func:`rank_main`, and what was seen of them.

    ``exitcodes[r]``: exit code of a rank that exited (negative: killed by that signal);
    ``seen_at[r]``: wall-clock time the launcher saw it exit; ``killed[r]``: why the launcher
    killed a rank that was still running (``timeout``, ``terminated`` or ``teardown``).
    """

    def __init__(self, specs: list[RankSpec], payload: bytes | None, *, target=rank_main,
                 extra_args: list[tuple] | None = None, name: str = "rlaudit-rank", ctx=None):
        """``target(spec, payload, *extra_args[rank])`` runs in each process (a warm pool passes
        its own target, no payload and a pipe end per rank); processes are named
        ``<name><rank>``. ``ctx``: the multiprocessing context that starts them (default spawn;
        a CPU warm pool forks them from its preloaded forkserver: ``_start``)."""
        ctx = ctx or mp.get_context("spawn")
        self.files: list[RankFiles] = [s.files for s in specs]
        extra = extra_args or [()] * len(specs)
        self.procs = [ctx.Process(target=target, args=(s, payload, *extra[s.rank]),
                                  name=f"{name}{s.rank}") for s in specs]
        self.exitcodes: dict[int, int] = {}
        self.seen_at: dict[int, float] = {}
        self.killed: dict[int, str] = {}

    def start(self) -> None:
        for p in self.procs:
            p.start()

    def running(self) -> list[int]:
        """Ranks whose exit has not been collected."""
        return [r for r in range(len(self.procs)) if r not in self.exitcodes]

    def has_result(self, rank: int) -> bool:
        return self.files[rank].result.exists()

    def supervise(self, timeout: float) -> str:
        """Watch the ranks until all exited or a clock (see module docstring) runs out.

        ``timeout``: seconds ``fn`` may run once every rank is ready. Returns why it stopped:
        ``exited``, ``failed``, ``teardown`` (results complete, some rank still tearing down) or
        ``timeout``; ranks still running are then left to :meth:`stop`.
        """
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        all_ready = first_failure = results_done = teardown_crash = None
        ranks = range(len(self.procs))
        while running := self.running():
            sentinels = {self.procs[r].sentinel: r for r in running}
            ready = mp.connection.wait(list(sentinels), timeout=_POLL_S)
            now = time.monotonic()
            for sentinel in ready:
                rank = sentinels[sentinel]
                self._collect(rank)
                if not self.has_result(rank):
                    first_failure = first_failure or now
                elif self.exitcodes[rank] != 0:
                    teardown_crash = teardown_crash or now
            if all_ready is None and all(self.files[r].ready.exists() for r in ranks):
                all_ready, deadline = now, now + timeout
            if results_done is None and all(map(self.has_result, ranks)):
                results_done = now
            if first_failure is not None:
                if now >= first_failure + FAILURE_GRACE_S:
                    return "failed"
            elif results_done is not None:
                limit = results_done + TEARDOWN_GRACE_S
                if teardown_crash is not None:
                    limit = min(limit, teardown_crash + FAILURE_GRACE_S)
                if now >= limit:
                    return "teardown"
            elif now >= deadline:
                return "timeout"
        return "exited"

    def stop(self, reason: str) -> None:
        """Kill every rank still running, recording why: ranks without a result first dump their
        Python stacks (SIGUSR1 -> faulthandler) so the report shows where they were stuck."""
        running = self.running()
        dumping = [r for r in running if not self.has_result(r)]
        for r in dumping:
            _signal(self.procs[r].pid, signal.SIGUSR1)
        until = time.monotonic() + STACK_DUMP_WAIT_S
        while dumping and time.monotonic() < until:
            # done: dumped, or gone (SIGUSR1 kills a rank still bootstrapping, before faulthandler)
            exited = set(mp.connection.wait([self.procs[r].sentinel for r in dumping], _POLL_S))
            dumping = [r for r in dumping if not _nonempty(self.files[r].stacks)
                       and self.procs[r].sentinel not in exited]
        gone = set(mp.connection.wait([self.procs[r].sentinel for r in running], 0))
        for r in running:
            why = "teardown" if self.has_result(r) else reason
            if self.procs[r].sentinel in gone:
                self._collect(r)  # it ended meanwhile: report how, unless our SIGUSR1 did it
                if self.exitcodes[r] == -signal.SIGUSR1:
                    self.killed[r] = why
                continue
            self.killed[r] = why
            self._collect(r, kill=True)

    def kill_all(self) -> None:
        """Make sure no rank (nor anything it started) outlives the launch. Idempotent."""
        for r in self.running():
            if self.procs[r].pid is not None:  # started
                self.killed.setdefault(r, "terminated")
                self._collect(r, kill=True)

    def outcomes(self) -> list[RankOutcome]:
        """One outcome per rank without a result (see :class:`RankOutcome`)."""
        out = []
        for r in range(len(self.procs)):
            if self.has_result(r):
                continue
            kind: Kind = "timeout" if self.killed.get(r) == "timeout" else "terminated"
            if r in self.killed:
                out.append(killed_outcome(r, kind, self.seen_at[r], self.files[r]))
            else:
                out.append(exited_outcome(r, self.exitcodes[r], self.seen_at[r], self.files[r]))
        return out

    def _collect(self, rank: int, *, kill: bool = False) -> None:
        """Kill the rank's process group (its leftovers, or all of it when ``kill``), then reap."""
        proc = self.procs[rank]
        _signal(proc.pid, signal.SIGKILL, group=True)
        if kill:
            _signal(proc.pid, signal.SIGKILL)  # not yet a group leader if still bootstrapping
        self.seen_at[rank] = time.time()
        proc.join(_REAP_WAIT_S)
        code = proc.exitcode
        self.exitcodes[rank] = -signal.SIGKILL if code is None else code
        if code is not None:
            proc.close()


def _signal(pid: int | None, sig: int, *, group: bool = False) -> None:
    """Send ``sig`` to a process (or the process group it leads); gone is fine."""
    if pid is None:
        return
    try:
        if group:
            os.killpg(pid, sig)
        else:
            os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _nonempty(path) -> bool:
    try:
        return path.stat().st_size > 0
    except OSError:
        return False
