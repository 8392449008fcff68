"""Keep the garbage collector off objects that live as long as the process.

After torch, transformers, megatron-core and a trainer's framework are imported, the heap holds
hundreds of thousands of objects that are never garbage. Every full collection walks them all
(0.26 s in a preloaded rank, 0.45 s in a pytest worker), and real trainers ask for full
collections themselves: accelerate's ``free_memory()`` runs ``gc.collect()`` at the start of
every ``Trainer.train()``, i.e. every TRL train_step. In a process that others are forked from,
walking them also writes to every page of the heap, which copy-on-write then duplicates.

While those modules are being imported, the heap grows by more than a quarter again and again,
and each time CPython runs a full collection on its own: eight in a forkserver's preload (0.9
CPU-s), nine in ``rlaudit run kl_k1`` (1.7 CPU-s), each walking a larger heap of objects that
are never garbage. :func:`importing` keeps them off an import-heavy block and freezes what it
built once, at its end.
"""

from __future__ import annotations

import contextlib
import gc
import sys
import threading

_frozen_at = 0  # len(sys.modules) at the last freeze
_lock = threading.Lock()
_importing = 0  # blocks inside importing(), any thread
_was_enabled = True
_collect = True  # whether the current run of importing() blocks ends with a collection


def freeze_long_lived(*, collect: bool = True) -> None:
    """Collect, then move everything alive out of the collector's sight (``gc.freeze``): on the
    first call, and again on any later call that finds modules imported since the last freeze
    (a trainer that imports its framework in its first step -- TRL's adapter does -- gets its
    imports frozen after that step). Any other call costs a ``len``. Objects created later are
    collected as usual; no result depends on it.

    ``collect=False`` freezes without collecting first, for a process that has only imported
    (the forkserver's preload): what imports leave unreachable is a few thousand small objects
    (3201 after the preload's 33 modules, measured), frozen with the rest instead of found by a
    walk of the whole heap (0.2-0.4 s there). Not for a process that has done other work: a
    cycle of garbage frozen is never freed."""
    global _frozen_at
    imported = len(sys.modules)
    if imported > _frozen_at:
        _frozen_at = imported
        if collect:
            gc.collect()
        gc.freeze()


@contextlib.contextmanager
def importing(*, collect: bool | None = None):
    """No automatic collection while the block runs (in any thread: the switch is the
    process's), then :func:`freeze_long_lived`. For blocks that mostly import; blocks may nest
    or overlap across threads -- when the last one leaves, collection resumes as it was before
    the first (a process that had it disabled keeps it disabled) and the one freeze runs (an
    inner block -- the model-code import inside the preload -- leaving earlier collects
    nothing). What is alive in other threads at the end is frozen too: still freed when its
    last reference goes, only a reference cycle among it would wait for the process's end.
    ``collect=False`` on the first block: freeze without collecting first (see
    :func:`freeze_long_lived`), unless a block entered while it runs says ``collect=True``;
    ``None`` (the default): as the blocks already running say, collecting when it is the first."""
    global _importing, _was_enabled, _collect
    with _lock:
        if _importing == 0:
            _was_enabled = gc.isenabled()
            _collect = collect is not False
            gc.disable()
        _importing += 1
        _collect = _collect or collect is True
    try:
        yield
    finally:
        with _lock:
            _importing -= 1
            last = _importing == 0
            if last and _was_enabled:
                gc.enable()
            wanted = _collect
        if last:
            freeze_long_lived(collect=wanted)
