"""Timing probe for benchmarks/suite_time.py (not part of rlaudit; never imported by it).

suite_time.py puts this folder first on PYTHONPATH, so Python imports it at start-up in *every*
process of the measured run: the CLI process and each spawned rank (spawn children inherit the
environment). It wraps a fixed set of rlaudit functions, from the outside, right after their
module is imported, and appends one JSON line per timed call to ``$RLAUDIT_PROBE_EVENTS``:

    {"ev": "replay", "t0": <time.time()>, "t1": ..., "pid": 123, "rank": null, "backend": "fsdp"}

Because it measures from the outside, the same probe times the code before and after a change
(``suite_time.py --ref b75782f``), as long as these names exist: rlaudit.cli.main.main,
rlaudit.scenarios.engine.{run_scenario,get_backend,load_rollout,build_variants,golden_mod},
rlaudit.scenarios.variants.build_variants (where it lives since it left the engine),
Invariant.check, rlaudit.backends.launch.launch,
rlaudit.backends.launch.pool.RankPool.{_start,_run_task},
rlaudit.backends.launch.worker.init_distributed,
rlaudit.backends.replay.replay_variant, rlaudit.backends.megatron.compat.init_megatron,
rlaudit.backends.megatron.convert.load_hf_checkpoint, rlaudit.report.{mlflow_log.log_invocation,
run_report.write_run_report}. A missing name is skipped (its phase then reads 0).

With ``$RLAUDIT_PROBE_COLLECTIVES=1`` (benchmarks/collective_count.py) it also times every
``torch.distributed`` collective called through the module's functions, as a ``collective`` event
with the function (``op``) and the first caller outside torch.distributed (``site``); FSDP2's own
gathers, issued from C++, are not seen.
"""

from __future__ import annotations

import builtins
import functools
import json
import os
import sys
import threading
import time

PROCESS_START = time.time()
_PATH = os.environ.get("RLAUDIT_PROBE_EVENTS")
#: top-level packages whose first import is timed (the heavy third-party ones)
HEAVY = frozenset({"torch", "megatron", "transformers", "mlflow", "vllm", "ray", "safetensors",
                   "pandas", "numpy", "matplotlib", "sqlalchemy", "tokenizers"})


def emit(ev: str, t0: float, t1: float, **labels) -> None:
    """One event. ``tid`` tells the CLI's concurrent scenarios apart; ``port`` (a rank's
    MASTER_PORT) tells which group a rank belongs to."""
    line = json.dumps({"ev": ev, "t0": t0, "t1": t1, "pid": os.getpid(),
                       "tid": threading.get_ident(), "rank": os.environ.get("RANK"),
                       "port": os.environ.get("MASTER_PORT"), **labels}, default=str)
    fd = os.open(_PATH, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (line + "\n").encode())  # one write per line: O_APPEND keeps lines whole
    finally:
        os.close(fd)


def timed(ev: str, fn, labels=lambda *a, **k: {}):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        t0 = time.time()
        try:
            return fn(*args, **kwargs)
        finally:
            emit(ev, t0, time.time(), **labels(*args, **kwargs))
    wrapper.__probe__ = True
    return wrapper


def _wrap_attr(obj, name: str, ev: str, labels=lambda *a, **k: {}) -> None:
    fn = getattr(obj, name, None)
    if fn is not None and not getattr(fn, "__probe__", False):
        setattr(obj, name, timed(ev, fn, labels))


# ---- imports ------------------------------------------------------------------------------------

_real_import = builtins.__import__
_depth = [0]


def _import(name, globals=None, locals=None, fromlist=(), level=0):
    top = name.partition(".")[0]
    if level or top not in HEAVY or top in sys.modules:
        return _real_import(name, globals, locals, fromlist, level)
    t0 = time.time()
    _depth[0] += 1
    try:
        return _real_import(name, globals, locals, fromlist, level)
    finally:
        _depth[0] -= 1
        emit("import", t0, time.time(), pkg=top, depth=_depth[0])


# ---- patches applied right after a module is imported -------------------------------------------

#: The scenario each thread is running (run_scenario's wrapper sets it): a backend's replay may
#: run in another thread (concurrent backends), so the replay event carries the scenario's name.
_current = threading.local()


class _BackendProxy:
    """What engine.get_backend returns under the probe: the backend with a timed ``replay`` (and
    ``replay_in_pool``)."""

    def __init__(self, inner):
        self._inner = inner
        self._scenario = getattr(_current, "scenario", None)

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def replay(self, request):
        return self._timed(self._inner.replay, request)

    def replay_in_pool(self, request, **kwargs):  # the reference beside multi-rank backends
        return self._timed(self._inner.replay_in_pool, request, **kwargs)

    def _timed(self, replay, request, **kwargs):
        t0 = time.time()
        try:
            return replay(request, **kwargs)
        finally:
            emit("replay", t0, time.time(), backend=self._inner.name,
                 variants=len(request.variants), scenario=self._scenario)


def _scenario_named(fn):
    @functools.wraps(fn)
    def wrapper(scn, *args, **kwargs):
        _current.scenario = scn.name
        try:
            return fn(scn, *args, **kwargs)
        finally:
            _current.scenario = None
    return wrapper


def _patch_engine(m) -> None:
    if getattr(m, "run_scenario", None) is not None:
        m.run_scenario = _scenario_named(m.run_scenario)
    _wrap_attr(m, "run_scenario", "scenario", lambda scn, *a, **k: {"scenario": scn.name})
    _wrap_attr(m, "load_rollout", "load")
    _wrap_attr(m, "build_variants", "variants")
    get_backend = getattr(m, "get_backend", None)
    if get_backend is not None:
        m.get_backend = lambda name: _BackendProxy(get_backend(name))
    golden = getattr(m, "golden_mod", None)
    if golden is not None:
        _wrap_attr(golden, "compare_or_bless", "golden")


def _patch_invariants(m) -> None:
    registry = m.INVARIANTS
    for name in registry:
        inv = registry.get(name)
        inv.check = timed("check", inv.check, lambda *a, _n=name, **k: {"invariant": _n})


def _pool_port(pool, *args, **kwargs) -> dict:
    """Evaluated after the call: the pool's rendezvous port (its ranks' MASTER_PORT)."""
    store = getattr(pool, "_store", None)
    return {"pool_port": str(store.port) if store is not None else None}


PATCHES = {
    "rlaudit.cli.main": lambda m: _wrap_attr(m, "main", "cli"),
    "rlaudit.scenarios.engine": _patch_engine,
    "rlaudit.scenarios.invariants": _patch_invariants,
    "rlaudit.scenarios.variants": lambda m: _wrap_attr(m, "build_variants", "variants"),
    "rlaudit.backends.launch": lambda m: _wrap_attr(m, "launch", "launch"),
    # a warm pool's start-up is a launch's spawn, a task its use (checkouts that have pools)
    "rlaudit.backends.launch.pool": lambda m: (
        _wrap_attr(m.RankPool, "_start", "launch", _pool_port),
        _wrap_attr(m.RankPool, "_run_task", "task", _pool_port)),
    "rlaudit.backends.launch.worker": lambda m: _wrap_attr(m, "init_distributed", "rendezvous"),
    "rlaudit.backends.replay": lambda m: _wrap_attr(
        m, "replay_variant", "variant",
        lambda make_roles, variant, *a, **k: {"variant": variant.name}),
    "rlaudit.backends.megatron.compat": lambda m: _wrap_attr(m, "init_megatron", "megatron_init"),
    "rlaudit.backends.megatron.convert": lambda m: _wrap_attr(m, "load_hf_checkpoint", "build"),
    "rlaudit.report.mlflow_log": lambda m: _wrap_attr(m, "log_invocation", "mlflow"),
    "rlaudit.report.run_report": lambda m: _wrap_attr(m, "write_run_report", "report"),
}


#: torch.distributed functions timed with $RLAUDIT_PROBE_COLLECTIVES=1
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor",
               "reduce_scatter", "broadcast", "barrier", "send", "recv", "isend", "irecv",
               "batch_isend_irecv", "all_to_all_single", "all_gather_object",
               "broadcast_object_list", "gather", "scatter", "reduce")


def _call_site() -> str:
    """``package/path.py:function`` of the innermost caller outside torch.distributed."""
    import traceback

    for frame in reversed(traceback.extract_stack()):
        name = frame.filename
        if name == __file__ or "/torch/distributed/" in name or name.endswith("functools.py"):
            continue
        for root in ("megatron/core/", "rlaudit/", "torch/"):
            if root in name:
                return f"{root.split('/')[0]}/{name.split(root)[-1]}:{frame.name}"
        return f"{os.path.basename(name)}:{frame.name}"
    return "?"


def _patch_distributed(m) -> None:
    if os.environ.get("RLAUDIT_PROBE_COLLECTIVES") == "1":
        for op in COLLECTIVES:
            _wrap_attr(m, op, "collective", lambda *a, _op=op, **k: {"op": _op,
                                                                     "site": _call_site()})


PATCHES["torch.distributed"] = _patch_distributed


def _timed_make_roles(replay_variant):
    """replay_variant(make_roles, variant): time make_roles (model build/convert/shard) apart."""
    @functools.wraps(replay_variant)
    def wrapper(make_roles, variant, *args, **kwargs):
        return replay_variant(timed("build", make_roles), variant, *args, **kwargs)
    return wrapper


def _after_import(name: str, module) -> None:
    try:
        if name == "rlaudit.backends.replay":
            module.replay_variant = _timed_make_roles(module.replay_variant)
        PATCHES[name](module)
    except Exception as e:  # noqa: BLE001 - a probe must never break the measured run
        sys.stderr.write(f"[probe] could not patch {name}: {type(e).__name__}: {e}\n")


class _PostImportFinder:
    """A meta-path finder that lets the real finders find the module, then patches it once it
    has executed (before anyone else can bind its functions by name)."""

    def find_spec(self, name, path=None, target=None):
        if name not in PATCHES:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None and spec.loader is not None:
                break
        else:
            return None
        loader = spec.loader
        real_exec = loader.exec_module

        def exec_module(module):
            real_exec(module)
            _after_import(name, module)

        loader.exec_module = exec_module
        return spec


if _PATH:
    builtins.__import__ = _import
    sys.meta_path.insert(0, _PostImportFinder())
    emit("process", PROCESS_START, PROCESS_START)
