"""Collective counter for benchmarks/collective_count.py (not part of rlaudit; never imported by it).

collective_count.py puts this folder first on PYTHONPATH, so every process of the measured run
(the CLI, the forkserver and each rank forked from it) imports it at start-up. Once
``torch.distributed`` is imported, its collective functions are wrapped from the outside: each
call is counted under ``<function> @ <first caller outside torch.distributed>`` with the wall
time spent inside, and the process's counts are rewritten to ``$RLAUDIT_COLLECTIVES_DIR/<pid>.json``
after every call (ranks may leave with ``os._exit``, which skips atexit). Collectives issued from
C++ (FSDP2's own parameter all-gathers and gradient reduce-scatters) are not seen.
"""

from __future__ import annotations

import builtins
import collections
import functools
import json
import os
import sys
import time
import traceback

_OUT = os.environ.get("RLAUDIT_COLLECTIVES_DIR")
NAMES = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor",
         "reduce_scatter", "broadcast", "barrier", "send", "recv", "isend", "irecv",
         "batch_isend_irecv", "all_to_all_single", "all_gather_object", "broadcast_object_list",
         "gather", "scatter", "reduce")
COUNTS: collections.Counter = collections.Counter()
SECONDS: collections.Counter = collections.Counter()
_real_import = builtins.__import__
_patched = [False]


def _dump() -> None:
    path = os.path.join(_OUT, f"{os.getpid()}.json")
    with open(path + ".tmp", "w") as f:
        json.dump({"rank": os.environ.get("RANK"), "port": os.environ.get("MASTER_PORT"),
                   "counts": COUNTS, "seconds": SECONDS}, f)
    os.replace(path + ".tmp", path)


def _site() -> str:
    for frame in reversed(traceback.extract_stack()[:-3]):
        name = frame.filename
        if "/torch/distributed/" in name or "_collectives" in name:
            continue
        for root in ("megatron/core/", "rlaudit/", "torch/"):
            if root in name:
                return f"{root.split('/')[0]}/{name.split(root)[-1]}:{frame.name}"
        return f"{os.path.basename(name)}:{frame.name}"
    return "?"


def _wrap(module, name: str) -> None:
    fn = getattr(module, name, None)
    if fn is None:
        return

    @functools.wraps(fn)
    def counted(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            key = f"{name} @ {_site()}"
            COUNTS[key] += 1
            SECONDS[key] += time.perf_counter() - t0
            _dump()

    setattr(module, name, counted)


def _import(name, *args, **kwargs):
    module = _real_import(name, *args, **kwargs)
    dist = sys.modules.get("torch.distributed")
    if not _patched[0] and dist is not None and hasattr(dist, "all_reduce"):
        _patched[0] = True
        for n in NAMES:
            _wrap(dist, n)
    return module


if _OUT:
    builtins.__import__ = _import
