"""What the launcher and its rank processes share: the rank's view (:class:`RankInfo`), the
picklable spec a rank starts from (:class:`RankSpec`), the per-rank file layout and atomic writes.

Nothing here imports torch at module level: a rank process imports this module while it is being
spawned, *before* it has set its environment (``OMP_NUM_THREADS``, NCCL variables, ...), and torch
must only be imported afterwards.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO, Callable

if TYPE_CHECKING:
    import torch

#: The default address of a launch's rendezvous store and ranks' sockets: loopback (all ranks
#: of a launch are local processes; see _rendezvous for an explicit host).
MASTER_ADDR = "127.0.0.1"


@dataclass(frozen=True)
class RankInfo:
    """What ``fn`` learns about the rank it runs in (its first argument).

    ``device`` is ``cpu`` or ``cuda:<local_rank>`` (already made current on CUDA); ``backend`` the
    torch.distributed backend of the default process group (``gloo``/``nccl``), already
    initialised; ``tmpdir`` a scratch folder *shared by all ranks of this launch* (create
    per-rank subfolders yourself), deleted when :func:`~rlaudit.backends.launch.launch` returns.
    """

    rank: int
    world_size: int
    local_rank: int
    device: "torch.device"
    backend: str
    tmpdir: Path


@dataclass(frozen=True)
class RankSpec:
    """Everything a rank process needs to start, passed through ``spawn`` (plain data, no torch).

    ``env`` is the complete set of variables the rank adds to its inherited environment (the
    user's ``env`` with the launcher's torchrun-style variables on top).
    """

    rank: int
    world_size: int
    local_rank: int
    device_type: str
    backend: str
    root: Path
    master_port: int
    timeout_s: float
    threads: int
    parent_pid: int
    env: dict[str, str] = field(default_factory=dict)
    master_addr: str = MASTER_ADDR
    """Where the launcher's rendezvous store listens (``launch(host=...)``)."""

    @property
    def files(self) -> "RankFiles":
        return RankFiles.of(self.root, self.rank)


@dataclass(frozen=True)
class RankFiles:
    """The files of one rank inside a launch folder.

    ``log``: the rank's stdout and stderr (file descriptors 1 and 2, so C/C++ output too).
    ``ready``: created once the rank has joined the process group, just before ``fn`` starts.
    ``stacks``: Python stacks of every thread, dumped by faulthandler when the launcher sends
    SIGUSR1 before killing a rank. ``result``: ``torch.save`` of ``fn``'s return value, present
    only once complete (written atomically). ``error``: a JSON record of an exception the rank
    caught (phase, type, message, traceback, wall-clock time).
    """

    log: Path
    ready: Path
    stacks: Path
    result: Path
    error: Path

    @classmethod
    def of(cls, root: Path, rank: int) -> "RankFiles":
        stem = root / f"rank{rank}"
        return cls(log=stem.with_suffix(".log"), ready=stem.with_suffix(".ready"),
                   stacks=stem.with_suffix(".stacks"),
                   result=stem.with_suffix(".result.pt"), error=stem.with_suffix(".error.json"))

    def for_task(self, task_dir: Path, rank: int) -> "RankFiles":
        """A warm pool's files for one task: the rank's own log, stacks and ready marker, the
        task's result and error record (under ``task_dir``)."""
        stem = task_dir / f"rank{rank}"
        return RankFiles(log=self.log, ready=self.ready, stacks=self.stacks,
                         result=stem.with_suffix(".result.pt"),
                         error=stem.with_suffix(".error.json"))


def scratch_dir(root: Path) -> Path:
    """The folder handed to ``fn`` as ``RankInfo.tmpdir``."""
    return root / "scratch"


def write_atomic(path: Path, write: Callable[[BinaryIO], None]) -> None:
    """Write ``path`` so that it either does not exist or is complete: ``write`` fills a temporary
    file in the same folder, which is then renamed over ``path`` (rename is atomic on POSIX)."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


#: Functions a warm pool's rank calls after each task, before its own reset (see
#: :func:`register_task_reset`).
TASK_RESETS: list[Callable[[], None]] = []


def register_task_reset(fn: Callable[[], None]) -> None:
    """Have every warm-pool rank call ``fn()`` after each task, in this process.

    For library state a task can leave behind that the pool cannot know about: e.g. megatron's
    parallel_state (the megatron backend registers :func:`teardown_megatron`). Runs before the
    pool destroys the task's process groups and restores the RNG. Idempotent per function."""
    if fn not in TASK_RESETS:
        TASK_RESETS.append(fn)
