"""An in-process memo of the reference backend's CPU replays.

A reference replay on the CPU is a pure function of what goes in: the model snapshots' contents
(``snapshot_id``), the variant (config, batch tensors by ``rollout_sha256``, steps), dtype, weight
noise, fault injectors and the intra-op thread count (which can move float64 sums in their last
bits). The same variant is replayed many times within one process: Hypothesis re-runs examples
while it shrinks (``rlaudit fuzz`` at run level), a found case is replayed after fuzzing, and
every run-level audit of a target replays the reference for the same scenarios. The memo keys a
replay by a digest of all of that and hands back a deep copy of the first result (a caller may
attach to or change what it gets), least recently used first out past
``RLAUDIT_REFERENCE_MEMO_MB`` (default 256; 0 turns the memo off).

Never memoised: CUDA replays (not bitwise reproducible: the point of ``golden calibrate``), the
drift localisation's probe re-runs, and anything under :func:`disabled` (repeat measurements).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import hashlib
import json
import threading
from collections import OrderedDict

import torch

from rlaudit.backends.base import ReplayRequest, Variant, VariantRun
from rlaudit.backends.dedupe import variant_digest
from rlaudit.model.load import snapshot_id
from rlaudit.switches import reference_memo_bytes

_lock = threading.Lock()
_entries: "OrderedDict[str, tuple[VariantRun, int]]" = OrderedDict()
_bytes = 0
_off = [0]   # depth of disabled() blocks, process-wide (replays may run in executor threads)
stats = {"hits": 0, "misses": 0}


def limit_bytes() -> int:
    """The memo's size limit in bytes (``$RLAUDIT_REFERENCE_MEMO_MB``, rlaudit/switches.py)."""
    return reference_memo_bytes()


@contextlib.contextmanager
def disabled():
    """Replays while this block runs (in any thread) are run, never answered from or added to the
    memo."""
    with _lock:
        _off[0] += 1
    try:
        yield
    finally:
        with _lock:
            _off[0] -= 1


def clear() -> None:
    global _bytes
    with _lock:
        _entries.clear()
        _initials.clear()
        _bytes = 0


def key(request: ReplayRequest, variant: Variant) -> str | None:
    """The digest a replay of ``variant`` under ``request`` is memoised by, or None when it must
    run (CUDA, a probe re-run, the memo disabled, a batch that cannot be digested)."""
    if (_off[0] or variant.probe is not None or request.device != "cpu"
            or limit_bytes() <= 0):
        return None
    variant_key = variant_digest(variant)   # config, steps, batch tensors, kinds, meta
    if variant_key is None:   # e.g. a nested tensor: just run it
        return None
    head = {"model": snapshot_id(request.model),
            "ref_model": snapshot_id(request.ref_model) if request.ref_model else None,
            "dtype": request.dtype, "noise": request.weight_noise,
            "draw": request.noise_draw, "faults": request.faults,
            "threads": torch.get_num_threads(), "variant": variant_key}
    text = json.dumps(head, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()


def _size(run: VariantRun) -> int:
    """Bytes of ``run``'s tensors, its initial parameters aside (see :func:`_interned`)."""
    tensors = [*run.tokens.values(), *run.params]
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


#: initial parameters of the memoised runs, one copy per distinct value: every replay of a model
#: snapshot starts from the same parameters (a third of a two-step run's bytes)
_initials: list[torch.Tensor] = []


def _interned(t: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(the kept tensor equal to ``t``, bytes newly kept). Call under ``_lock``."""
    for kept in _initials:
        if kept.shape == t.shape and kept.dtype == t.dtype and torch.equal(kept, t):
            return kept, 0
    kept = t.detach().clone()
    _initials.append(kept)
    return kept, kept.numel() * kept.element_size()


def lookup(k: str | None) -> VariantRun | None:
    if k is None:
        return None
    with _lock:
        hit = _entries.get(k)
        if hit is None:
            stats["misses"] += 1
            return None
        _entries.move_to_end(k)
        stats["hits"] += 1
        run = hit[0]
    return copy.deepcopy(run)


def store(k: str | None, run: VariantRun) -> None:
    global _bytes
    if k is None:
        return
    kept = copy.deepcopy(dataclasses.replace(run, params_initial=None))
    size = _size(kept)
    limit = limit_bytes()
    if size > limit:
        return
    with _lock:
        if k in _entries:
            return
        if run.params_initial is not None:
            kept.params_initial, new = _interned(run.params_initial)
            _bytes += new
        _entries[k] = (kept, size)
        _bytes += size
        while _bytes > limit and _entries:
            _, (gone, dropped) = _entries.popitem(last=False)
            _bytes -= dropped + _release(gone.params_initial)


def _release(initial: torch.Tensor | None) -> int:
    """Forget ``initial`` (an interned tensor of an evicted run) when no kept run starts from it;
    the bytes freed. Call under ``_lock``."""
    if initial is None or any(run.params_initial is initial for run, _ in _entries.values()):
        return 0
    for i, kept in enumerate(_initials):
        if kept is initial:
            del _initials[i]
            return kept.numel() * kept.element_size()
    return 0
