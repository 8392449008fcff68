"""Path and number options checked before a command does anything: a ``--report-dir`` that is a
file, an ``--out`` that is a directory, a NaN ``--timeout`` are usage errors (exit 2, the flag
and the path named), not an OSError from deep inside a run after its replays.

    check_dir_option(Path("reports"), "--report-dir")
"""

from __future__ import annotations

import math
import os
import sqlite3
from pathlib import Path

from rlaudit.errors import InputError
from rlaudit.executors.ray_address import probe_ray_address


def _blocking_ancestor(path: Path) -> Path | None:
    """The nearest existing ancestor of ``path`` when it is not a directory (so nothing can be
    created under it), else None."""
    for parent in path.parents:
        if parent.exists():
            return None if parent.is_dir() else parent
    return None


def check_dir_option(path: str | Path, flag: str) -> None:
    """``path`` is a directory or can be created as one."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise InputError(f"{path} is a file, expected a directory", key=flag)
    blocker = _blocking_ancestor(path)
    if blocker is not None:
        raise InputError(f"{path} cannot be a directory: {blocker} is a file", key=flag)


def check_file_option(path: str | Path, flag: str) -> None:
    """``path`` is a file or can be created as one (its directory included)."""
    path = Path(path)
    if path.is_dir():
        raise InputError(f"{path} is a directory, expected a file path", key=flag)
    blocker = _blocking_ancestor(path)
    if blocker is not None:
        raise InputError(f"{path} cannot be written: {blocker} is a file, not a directory",
                         key=flag)


def check_positive(value: float | int | None, flag: str, *, integer: bool = False) -> None:
    """``value`` (when given) is a finite number > 0 (an integer >= 1 with ``integer``)."""
    if value is None:
        return
    if integer and value < 1:
        raise InputError(f"expected an integer >= 1, got {value}", key=flag)
    if not integer and not (math.isfinite(value) and value > 0):
        raise InputError(f"expected a finite number of seconds > 0, got {value}", key=flag)


def check_sqlite_store(db: Path, flag: str) -> None:
    """An existing sqlite file reads as a database (sqlite3, before MLflow's seconds of imports
    meet it as a traceback): InputError naming ``flag`` and the file when it is truncated,
    corrupt or not a database."""
    if not db.is_file():
        return
    try:
        con = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5)
        try:
            verdict = con.execute("PRAGMA quick_check(1)").fetchone()
        finally:
            con.close()
    except sqlite3.Error as e:
        verdict = (str(e),)
    if verdict and verdict[0] != "ok":
        raise InputError(f"the MLflow store {db} cannot be read (truncated or corrupt?): "
                         f"{verdict[0]}", key=flag)


def check_run_options(args) -> None:
    """``rlaudit run`` and ``rlaudit golden``'s options that name places and amounts."""
    for flag, attr in (("--report-dir", "report_dir"), ("--golden-dir", "golden_dir")):
        if getattr(args, attr, None) is not None:
            check_dir_option(getattr(args, attr), flag)
    check_positive(getattr(args, "timeout", None), "--timeout")
    check_positive(getattr(args, "jobs", None), "--jobs", integer=True)
    if getattr(args, "executor", None) == "ray":  # before validation: a bad address in seconds
        flag = "--ray-address" if args.ray_address else "RAY_ADDRESS"
        probe_ray_address(args.ray_address or os.environ.get("RAY_ADDRESS"), flag=flag)


def check_train_options(args) -> None:
    """``rlaudit train``'s output places."""
    if args.metrics_out:
        check_file_option(args.metrics_out, "--metrics-out")
    for flag, attr in (("--checkpoint-dir", "checkpoint_dir"), ("--export", "export")):
        if getattr(args, attr, None):
            check_dir_option(getattr(args, attr), flag)


def check_record_options(args) -> None:
    """``rlaudit record``'s output file and sampling numbers (a NaN temperature samples
    garbage that looks like a model's)."""
    check_file_option(args.out, "--out")
    check_dir_option(Path(args.out).parent, "--out")
    if not (math.isfinite(args.temperature) and args.temperature > 0):
        raise InputError(f"expected a finite number > 0, got {args.temperature}",
                         key="--temperature")
    if not 0 < args.top_p <= 1:  # NaN fails too
        raise InputError(f"expected a number in (0, 1], got {args.top_p}", key="--top-p")
    if args.top_k < -1:
        raise InputError(f"expected -1 or 0 (off) or an integer >= 1, got {args.top_k}",
                         key="--top-k")
