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

_frozen = False


def freeze_long_lived() -> None:
    """Once per process: collect, then move everything alive out of the collector's sight
    (``gc.freeze``). Objects created later are collected as usual; no result depends on it."""
    global _frozen
    if not _frozen:
        _frozen = True
        gc.collect()
        gc.freeze()
