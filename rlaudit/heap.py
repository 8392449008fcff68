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


def freeze_long_lived() -> None:
    """Collect, then move everything alive out of the collector's sight (``gc.freeze``): on the
    first call, and again on any later call that finds modules imported since the last freeze
    (a trainer that imports its framework in its first step -- TRL's adapter does -- gets its
    imports frozen after that step). Any other call costs a ``len``. Objects created later are
    collected as usual; no result depends on it."""
    global _frozen_at
    imported = len(sys.modules)
    if imported > _frozen_at:
        _frozen_at = imported
        gc.collect()
        gc.freeze()


@contextlib.contextmanager
def importing():
    """No automatic collection while the block runs (in any thread: the switch is the
    process's), then :func:`freeze_long_lived`. For blocks that mostly import; blocks may nest
    or overlap across threads -- when the last one leaves, collection resumes as it was before
    the first (a process that had it disabled keeps it disabled) and the one freeze runs (an
    inner block -- the model-code import inside the preload -- leaving earlier collects
    nothing). What is alive in other threads at the end is frozen too: still freed when its
    last reference goes, only a reference cycle among it would wait for the process's end."""
    global _importing, _was_enabled
    with _lock:
        if _importing == 0:
            _was_enabled = gc.isenabled()
            gc.disable()
        _importing += 1
    try:
        yield
    finally:
        with _lock:
            _importing -= 1
            last = _importing == 0
            if last and _was_enabled:
                gc.enable()
        if last:
            freeze_long_lived()
