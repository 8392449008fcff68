"""The executor ``rlaudit run --executor`` names (see :mod:`rlaudit.executors`)."""

from __future__ import annotations

from typing import Callable

from rlaudit.errors import InputError
from rlaudit.executors.local import LOCAL_JOBS, LocalExecutor
from rlaudit.executors.planning import job_count
from rlaudit.executors.progress import Progress
from rlaudit.executors.ray_executor import RayExecutor

EXECUTORS = ("local", "ray")


def make_executor(name: str, scenarios, *, backends: list[str] | None = None,
                  progress: bool = True, ray_address: str | None = None,
                  jobs: int = LOCAL_JOBS, timeout: float = 300.0,
                  when_idle: Callable[[], object] | None = None):
    """The executor called ``name`` (see :data:`EXECUTORS`) with a progress display over the
    scenarios' jobs. ``timeout``: what the multi-rank replays will be given (the local
    executor's prestarted pools take it as their process groups' timeout, as a pool started by
    the replay would). ``when_idle``: see :class:`LocalExecutor`."""
    total = job_count(scenarios, backends)
    if isinstance(jobs, bool) or not isinstance(jobs, int) or jobs < 1:
        raise InputError(f"expected an integer >= 1, got {jobs!r}", key="--jobs")
    if name == "ray":
        return RayExecutor(total, address=ray_address, progress=progress,
                           gpu=any(scn.device == "cuda" for scn in scenarios))
    return LocalExecutor(Progress(total, enabled=progress), jobs=jobs, scenarios=scenarios,
                         backends=backends, timeout=timeout, when_idle=when_idle)
