"""Every ``RLAUDIT_*`` environment switch, named and read here only (the table of them, with
defaults and meanings: docs/internals.md, "Switches"; tests/test_switches.py keeps both true).

Each accessor reads the environment when it is called, never at import: tests set switches with
``monkeypatch.setenv``, and a rank process reads the environment its launcher gave it. A value a
switch cannot take raises :class:`~rlaudit.errors.InputError` naming the variable (exit code 2).
"""

from __future__ import annotations

import os

from rlaudit.errors import InputError

CACHE_DIR = "RLAUDIT_CACHE_DIR"
FAULT = "RLAUDIT_FAULT"
FORWARD_MEMO = "RLAUDIT_FORWARD_MEMO"
GOLDEN = "RLAUDIT_GOLDEN"
PEERS_DIR = "RLAUDIT_PEERS_DIR"
PIN_RANKS = "RLAUDIT_PIN_RANKS"
PRELOAD_ACTIVE = "RLAUDIT_PRELOAD_ACTIVE"
PRELOAD_LOG = "RLAUDIT_PRELOAD_LOG"
REFERENCE_MEMO_MB = "RLAUDIT_REFERENCE_MEMO_MB"
REPORTS = "RLAUDIT_REPORTS"
SCENARIOS = "RLAUDIT_SCENARIOS"
SLIME_DIR = "RLAUDIT_SLIME_DIR"
START_METHOD = "RLAUDIT_START_METHOD"
THREADS = "RLAUDIT_THREADS"

#: Every switch (the docs table lists each).
ALL = (CACHE_DIR, FAULT, FORWARD_MEMO, GOLDEN, PEERS_DIR, PIN_RANKS, PRELOAD_ACTIVE, PRELOAD_LOG,
       REFERENCE_MEMO_MB, REPORTS, SCENARIOS, SLIME_DIR, START_METHOD, THREADS)

#: Intra-op threads of the process that replays the reference backend and checks invariants:
#: 1, as in every rank and in the test suite. float64 results differ in the last bit between
#: thread counts, so a fixed count keeps them the same on every machine; and on a busy 2-core
#: machine two threads contending made the in-process reference replays several times slower.
#: RLAUDIT_THREADS overrides it.
DEFAULT_THREADS = 1
#: The reference backend's replay memo, in MiB (rlaudit/backends/memo.py).
DEFAULT_REFERENCE_MEMO_MB = 256
#: How rank processes may start (rlaudit/backends/launch/start.py).
START_METHODS = ("forkserver", "spawn")
_SOURCE = "environment"


def read(name: str) -> str | None:
    """The raw value of switch ``name`` (one of :data:`ALL`), None when unset: for tables keyed
    by switch name (the snapshot peers' checkout folders)."""
    if name not in ALL:
        raise KeyError(f"{name} is not an rlaudit switch (rlaudit/switches.py)")
    return os.environ.get(name)


def cache_dir() -> str | None:
    """Where rlaudit caches the catalogue; None (unset or empty): the XDG cache folder."""
    return os.environ.get(CACHE_DIR) or None


def fault_spec() -> str:
    """The test-only fault injectors' spec (rlaudit/backends/faults.py); empty: none."""
    return os.environ.get(FAULT, "")


def forward_memo() -> bool:
    """Whether replays memoise forward passes: unset or 1 on, 0 off."""
    raw = os.environ.get(FORWARD_MEMO, "1").strip()
    if raw not in ("0", "1"):
        raise InputError(f"expected 0 (off) or 1 (on), got {raw!r}", source=_SOURCE,
                         key=FORWARD_MEMO)
    return raw == "1"


def golden_dir(default: str) -> str:
    return os.environ.get(GOLDEN, default)


def scenarios_dir(default: str) -> str:
    return os.environ.get(SCENARIOS, default)


def reports_dir(default: str) -> str:
    return os.environ.get(REPORTS, default)


def peers_dir() -> str | None:
    """Where ``make peers`` installs peers; None (unset or empty): ``<repository>/.peers``."""
    return os.environ.get(PEERS_DIR) or None


def pin_ranks() -> bool:
    """Whether warm pools' ranks are pinned to blocks of cores when oversubscribed: ``auto``
    (the default) or ``off``."""
    value = os.environ.get(PIN_RANKS, "auto").strip().lower()
    if value not in ("auto", "off"):
        raise InputError(f"expected 'auto' or 'off', got {value!r}", source=_SOURCE,
                         key=PIN_RANKS)
    return value == "auto"


def preload_active() -> bool:
    """Set to 1 only in the forkserver's environment while it starts, so its preload runs
    there and nowhere else."""
    return os.environ.get(PRELOAD_ACTIVE) == "1"


def preload_log() -> str:
    """Where the forkserver's preload writes its output: the file named, else nowhere."""
    return os.environ.get(PRELOAD_LOG) or os.devnull


def reference_memo_bytes() -> int:
    """The reference replay memo's limit in bytes (a number of MiB >= 0; 0 turns it off)."""
    raw = os.environ.get(REFERENCE_MEMO_MB, str(DEFAULT_REFERENCE_MEMO_MB))
    try:
        mb = float(raw)
    except ValueError:
        mb = -1.0
    if not mb >= 0:   # also NaN
        raise InputError(f"expected a number of MiB >= 0 (0 turns the memo off), got {raw!r}",
                         source=_SOURCE, key=REFERENCE_MEMO_MB)
    return int(mb * (1 << 20))


def start_method() -> str | None:
    """The start method asked for CPU ranks (one of :data:`START_METHODS`); None: the default."""
    chosen = os.environ.get(START_METHOD, "").strip() or None
    if chosen is not None and chosen not in START_METHODS:
        raise InputError(f"expected one of {', '.join(START_METHODS)}, got {chosen!r}",
                         source=_SOURCE, key=START_METHOD)
    return chosen


def threads() -> int:
    """Intra-op threads of the process replaying the reference (see :data:`DEFAULT_THREADS`)."""
    value = os.environ.get(THREADS, str(DEFAULT_THREADS))
    try:
        count = int(value)
    except ValueError:
        count = 0
    if count < 1:
        raise InputError(f"expected an integer >= 1, got {value!r}", source=_SOURCE, key=THREADS)
    return count
