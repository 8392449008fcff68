"""The code that runs inside each rank process started by :func:`rlaudit.backends.launch.launch`.

Order matters and is the point of this module:

1. become the leader of a new process group (so the launcher can kill the rank *and anything it
   started* with one ``killpg``), send fds 1/2 to the rank's log file, arm faulthandler (fatal
   signals dump the Python stack into the log; SIGUSR1 dumps every thread into ``rank<r>.stacks``),
   start a watchdog that kills the group if the launcher dies;
2. set the environment, *then* import torch and unpickle ``fn`` and its arguments (they arrive as
   bytes so that unpickling, which imports the user's module and torch, happens after step 2);
3. initialise torch.distributed from the launcher's TCP store, run ``fn``;
4. write the result atomically; only then ``barrier()`` + ``destroy_process_group()``;
5. leave with ``os._exit`` (after flushing), which skips interpreter/static teardown where gloo
   sometimes aborts; ``atexit`` handlers therefore do not run in ranks.

Any exception in 2-4 is written to ``rank<r>.error.json`` (phase, type, message, traceback) and the
rank exits at once *without* entering a collective, so a raising rank can never leave its peers
waiting for it: the launcher sees the exit, collects the record and kills the rest.
"""

from __future__ import annotations

import ctypes
import faulthandler
import json
import os
import pickle
import shutil
import signal
import sys
import threading
import time
import traceback
from datetime import timedelta
from pathlib import Path

from rlaudit.backends.launch.common import (RankFiles, RankInfo, RankSpec, scratch_dir,
                                            write_atomic)

#: Exit code of a rank that caught an exception before its result was complete.
EXIT_RAISED = 3
#: Exit code of a rank whose result is complete but whose barrier/destroy raised.
EXIT_TEARDOWN_FAILED = 4
#: How often a rank checks that the launcher is still alive (seconds); bounds orphan lifetime.
_PARENT_POLL_S = 1.0
#: Text of errors a rank gets when a *peer* vanished mid-collective: such an error is a
#: consequence of another rank's failure, not a cause, and is reported after the causes.
_PEER_LOST_MARKERS = ("connection closed by peer", "connection reset by peer", "broken pipe",
                      "socket closed", "communicator was aborted", "timed out in call to wait")


def rank_main(spec: RankSpec, payload: bytes) -> None:
    """Entry point of a rank process (the ``spawn`` target). Never returns: ends in ``os._exit``.

    ``payload`` is ``pickle.dumps((fn, args, kwargs))`` made by the launcher.
    """
    files = setup_process(spec)
    phase = "import"
    try:
        import torch  # lazy: a rank imports torch only after its environment is set

        torch.set_num_threads(spec.threads)
        fn, args, kwargs = pickle.loads(payload)
        phase = "init"
        info = init_distributed(spec)
        files.ready.touch()
        phase = "fn"
        result = fn(info, *args, **kwargs)
        phase = "result"
        write_atomic(files.result, lambda f: torch.save(result, f))
    except BaseException as exc:  # noqa: BLE001 - every failure must reach the launcher
        record_error(spec, phase, exc)
        exit_rank(EXIT_RAISED)

    try:
        _teardown()
    except BaseException as exc:  # noqa: BLE001
        record_error(spec, "teardown", exc)
        exit_rank(EXIT_TEARDOWN_FAILED)
    exit_rank(0)


def setup_process(spec: RankSpec) -> RankFiles:
    """Step 1 of the module docstring, and the environment: what every rank process (one-shot or
    warm pool) does first. Returns the rank's files."""
    os.setpgid(0, 0)
    files = spec.files
    log_fd = os.open(files.log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    os.close(log_fd)
    for stream in (sys.stdout, sys.stderr):
        if hasattr(stream, "reconfigure"):
            stream.reconfigure(line_buffering=True)  # the log tail is current even if killed
    faulthandler.enable(file=sys.stderr, all_threads=True)
    stacks = open(files.stacks, "w")  # kept open: faulthandler writes to its fd from a signal
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
    threading.Thread(target=_watch_parent, args=(spec.parent_pid, spec.root), daemon=True,
                     name="rlaudit-parent-watchdog").start()
    os.environ.update(spec.env)
    return files


def init_distributed(spec: RankSpec) -> RankInfo:
    """Join the launcher's TCP store and initialise the default process group."""
    import torch  # lazy: a rank imports torch only after its environment is set
    import torch.distributed as dist  # lazy: as above

    timeout = timedelta(seconds=spec.timeout_s)
    device = torch.device("cpu")
    device_id = None
    if spec.device_type == "cuda":
        device = torch.device("cuda", spec.local_rank)
        torch.cuda.set_device(device)
        device_id = device if spec.backend == "nccl" else None
    store = dist.TCPStore(spec.master_addr, spec.master_port, spec.world_size, is_master=False,
                          timeout=timeout)
    dist.init_process_group(spec.backend, store=store, rank=spec.rank,
                            world_size=spec.world_size, timeout=timeout, device_id=device_id)
    return RankInfo(rank=spec.rank, world_size=spec.world_size, local_rank=spec.local_rank,
                    device=device, backend=spec.backend, tmpdir=scratch_dir(spec.root))


def _teardown() -> None:
    """Wait for every rank's result, then leave the group (looked up at call time: tests patch
    ``dist.barrier`` to simulate a crash in teardown)."""
    import torch.distributed as dist  # lazy: a rank imports torch only after its environment is set

    dist.barrier()
    dist.destroy_process_group()


def is_peer_lost(exc: BaseException) -> bool:
    """True when ``exc`` looks like the echo of a peer rank's death inside a collective."""
    try:
        # lazy: a rank imports torch only after its environment is set
        from torch.distributed import DistNetworkError
        if isinstance(exc, DistNetworkError):
            return True
    except ImportError:  # torch failed to import: certainly not a collective error
        pass
    text = f"{type(exc).__name__}: {exc}".lower()
    return any(marker in text for marker in _PEER_LOST_MARKERS)


def record_error(spec: RankSpec, phase: str, exc: BaseException, *,
                  path: Path | None = None) -> None:
    """Write the error record (to ``path``, default the rank's error file), then a marker line in
    the log (the report carries the traceback)."""
    when = time.time()
    tb = "".join(traceback.format_exception(exc))
    try:
        message = str(exc)
    except Exception:  # noqa: BLE001 - a broken __str__ must not hide the failure
        message = f"<unprintable {type(exc).__name__}>"
    record = {"rank": spec.rank, "phase": phase, "time": when,
              "type": f"{type(exc).__module__}.{type(exc).__qualname__}",
              "message": message, "traceback": tb, "peer_lost": is_peer_lost(exc)}
    try:
        write_atomic(path or spec.files.error, lambda f: f.write(json.dumps(record).encode()))
    finally:
        sys.stderr.write(f"[rlaudit] rank {spec.rank} failed in {phase}: "
                         f"{type(exc).__name__}: {message}\n")


def _watch_parent(launcher_pid: int, root: Path) -> None:
    """Once the launcher has gone (killed hard), remove its launch folder, which nobody will read,
    and kill this rank's whole process group.

    A spawned rank is the launcher's child: its parent changing means the launcher is gone. A
    rank forked from the launcher's forkserver (``_start``) is the forkserver's child, and the
    forkserver may be stopped while the rank still serves its pool: such a rank watches the
    launcher's pid itself."""
    spawned = os.getppid() == launcher_pid
    while True:
        if (os.getppid() != launcher_pid) if spawned else not _alive(launcher_pid):
            shutil.rmtree(root, ignore_errors=True)
            os.killpg(0, signal.SIGKILL)
        time.sleep(_PARENT_POLL_S)


def _alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie, dead but not yet reaped, counts as gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    except OSError:  # no /proc here: ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def exit_rank(code: int) -> None:
    """Flush Python and C stdio, then leave without interpreter teardown."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001
            pass
    try:
        ctypes.CDLL(None).fflush(None)
    except Exception:  # noqa: BLE001 - best effort: not every libc is reachable this way
        pass
    os._exit(code)
