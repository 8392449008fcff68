"""The code that runs inside each rank of a warm pool (:class:`~rlaudit.backends.launch.pool.RankPool`).

A pool rank starts like a one-shot rank (``_worker.setup_process``: own process group, log file,
faulthandler, parent watchdog, environment; then ``import torch`` and the process group), and
then serves tasks from its pipe until told to close:

    ("task", task_id, task_dir, payload, cpus)
                                          ->  move onto ``cpus`` (None: the cores it started
                                              with; rlaudit/backends/launch/placement.py), run
                                              fn, write ``task_dir/rank<r>.result.pt``
                                              atomically, reset, answer b"done",
                                              collect the task's garbage
    ("close",)                            ->  leave (os._exit: no barrier, no gloo teardown)

Failure rules are the one-shot launcher's: a task that raises writes its error record
(``task_dir/rank<r>.error.json``) and the rank exits at once, without entering another collective;
the pool then reports the task's ranks, kills the group and starts a fresh one for the next task.

Between tasks the rank puts back what a task may leave behind, so that a task sees the process
as a fresh rank would (the isolation test runs scenarios in two orders and compares bit for bit):

- registered resets (``_common.register_task_reset``; megatron's parallel_state);
- every process group but the default one (TP/PP/DP sub-groups of one layout are not reused by
  the next: each layout builds its own);
- the RNG states (torch CPU and CUDA, ``random``, numpy) as they were before the first task;
- default dtype, grad mode, deterministic-algorithms flag, the intra-op thread count;
- garbage (``gc.collect``), so the previous task's models are freed before the next builds its own:
  collected after the answer (0.1-0.2 s in a Megatron rank, on no one's path then -- the next task
  waits in the pipe until it is done), as nothing in it can fail the task.

What it cannot put back: a task that patches module attributes (tests that inject failures by
monkeypatching inside a rank use the one-shot :func:`~rlaudit.backends.launch.launch`).
"""

from __future__ import annotations

import dataclasses
import gc
import pickle
import random
import sys
from pathlib import Path

from rlaudit.backends.launch.common import TASK_RESETS, RankSpec, write_atomic
from rlaudit.backends.launch.placement import pin_threads, usable_cpus
from rlaudit.backends.launch.worker import (EXIT_RAISED, exit_rank, init_distributed,
                                            record_error, setup_process)

#: Answer on the pipe once a task's result file is complete.
DONE = b"done"


def pool_rank_main(spec: RankSpec, payload: None, conn) -> None:
    """Entry point of a pool rank (the ``spawn`` target). Never returns: ends in ``os._exit``."""
    del payload  # tasks arrive on the pipe
    files = setup_process(spec)
    phase = "import"
    try:
        import torch  # lazy: a rank imports torch only after its environment is set

        torch.set_num_threads(spec.threads)
        phase = "init"
        info = init_distributed(spec)
        state = ProcessState.capture(spec.threads, spec.device_type)
        placed = Placed()
        files.ready.touch()
    except BaseException as exc:  # noqa: BLE001 - every failure must reach the launcher
        record_error(spec, phase, exc)
        exit_rank(EXIT_RAISED)

    while True:
        try:
            message = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):  # the pool's end of the pipe is gone
            exit_rank(0)
        if message[0] != "task":
            exit_rank(0)
        _, task_id, task_dir, payload, cpus = message
        task_dir = Path(task_dir)
        task_files = files.for_task(task_dir, spec.rank)
        phase = "import"  # unpickling imports fn's module
        try:
            placed.move(cpus)
            fn, args, kwargs = pickle.loads(payload)
            phase = "fn"
            result = fn(dataclasses.replace(info, tmpdir=task_dir / "scratch"), *args, **kwargs)
            phase = "result"
            write_atomic(task_files.result, lambda f: torch.save(result, f))
            del result, fn, args, kwargs
            phase = "reset"
            state.restore(collect=False)
        except BaseException as exc:  # noqa: BLE001
            record_error(spec, phase, exc, path=task_files.error)
            exit_rank(EXIT_RAISED)
        try:
            conn.send_bytes(DONE + b":" + str(task_id).encode())
        except (BrokenPipeError, OSError):
            exit_rank(0)
        gc.collect()


class Placed:
    """The cores this rank's threads are on: the ones it started with until a task names others
    (rlaudit/backends/launch/placement.py); a task that names none gets the start ones back."""

    def __init__(self):
        self.start = tuple(usable_cpus())
        self.now = self.start

    def move(self, cpus) -> None:
        want = tuple(cpus) if cpus else self.start
        if want and want != self.now and pin_threads(want):
            self.now = want


@dataclasses.dataclass
class ProcessState:
    """Process-wide state a task may change, as it was before the first task (the Ray executor's
    rank actors use it too)."""

    threads: int
    torch_rng: object
    cuda_rng: list | None
    py_rng: object
    np_rng: object | None
    default_dtype: object
    grad_enabled: bool
    deterministic: bool

    @classmethod
    def capture(cls, threads: int, device_type: str) -> "ProcessState":
        import torch  # lazy: a rank imports torch only after its environment is set

        numpy = sys.modules.get("numpy")
        cuda = device_type == "cuda" and torch.cuda.is_available()
        return cls(threads=threads, torch_rng=torch.get_rng_state(),
                   cuda_rng=torch.cuda.get_rng_state_all() if cuda else None,
                   py_rng=random.getstate(),
                   np_rng=numpy.random.get_state() if numpy is not None else None,
                   default_dtype=torch.get_default_dtype(), grad_enabled=torch.is_grad_enabled(),
                   deterministic=torch.are_deterministic_algorithms_enabled())

    def restore(self, *, collect: bool = True) -> None:
        """Put the state back; ``collect``: and collect the garbage (a pool rank does that
        after answering)."""
        import torch  # lazy: a rank imports torch only after its environment is set

        for reset in list(TASK_RESETS):
            reset()
        destroy_subgroups()
        if collect:
            gc.collect()
        torch.set_rng_state(self.torch_rng)
        if self.cuda_rng is not None:
            torch.cuda.set_rng_state_all(self.cuda_rng)
        random.setstate(self.py_rng)
        if self.np_rng is not None:
            sys.modules["numpy"].random.set_state(self.np_rng)
        torch.set_default_dtype(self.default_dtype)
        torch.set_grad_enabled(self.grad_enabled)
        torch.use_deterministic_algorithms(self.deterministic)
        torch.set_num_threads(self.threads)


def destroy_subgroups() -> None:
    """Destroy every process group except the default one (local: no collective is entered)."""
    import torch.distributed as dist  # lazy: a rank imports torch only after its environment is set
    from torch.distributed.distributed_c10d import _world  # lazy: as above

    default = _world.default_pg
    for group in list(_world.pg_map):
        if group is not default:
            dist.destroy_process_group(group)
