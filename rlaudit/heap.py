"""Keep the garbage collector off objects that live as long as the process.

After torch, transformers, megatron-core and a trainer's framework are imported, the heap holds
hundreds of thousands of objects that are never garbage. Every full collection walks them all
(0.26 s in a preloaded rank, 0.45 s in a pytest worker), and real trainers ask for full
collections themselves: accelerate's ``free_memory()`` runs ``gc.collect()`` at the start of
every ``Trainer.train()``, i.e. every TRL train_step. In a process that others are forked from,
walking them also writes to every page of the heap, which copy-on-write then duplicates.
"""

from __future__ import annotations

import gc
import sys

_frozen_at = 0  # len(sys.modules) at the last freeze


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
