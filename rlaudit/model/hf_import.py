"""Import transformers' model code without scikit-learn.

Every HF model class carries ``GenerationMixin``, whose module imports
``transformers.generation.candidate_generator``, which imports ``sklearn.metrics.roc_curve``
whenever scikit-learn is installed -- and MLflow installs it. That import pulls scikit-learn,
scipy.stats and pandas: measured on the 2-core CI machine, the model modules take 1.85 s to import
with it and 1.1 s without, in every process that loads a model (the CLI for the reference backend,
the forkserver CPU ranks are forked from, each spawned CUDA rank). The only user of ``roc_curve``
in transformers is assisted generation with a confidence-threshold assistant model, which
rlaudit never runs.

:func:`import_model_code` imports that module once with ``sklearn`` hidden (``sys.modules``
entry ``None``, which makes ``importlib.util.find_spec`` answer "not installed"), then un-hides
it: ``import sklearn`` works as before afterwards. transformers caches its answer, so in this
process it treats scikit-learn as absent (consistently: assisted generation would say so).
Nothing is hidden when the module is imported already or scikit-learn is loaded already (nothing
left to save). When the import fails with scikit-learn hidden -- transformers had already
answered "installed" and so imports it, or a release needs it there -- the module is imported
again with nothing hidden and transformers' cached answer dropped.
"""

from __future__ import annotations

import sys

#: the transformers module that imports scikit-learn
SKLEARN_USER = "transformers.generation.candidate_generator"


def import_model_code() -> bool:
    """Import :data:`SKLEARN_USER` with scikit-learn hidden, if that still saves anything.
    Returns whether it stayed hidden (False: imported with scikit-learn, or nothing to do)."""
    if SKLEARN_USER in sys.modules or "sklearn" in sys.modules:
        return False
    from rlaudit.heap import importing

    with importing():  # most of transformers: no full collections on the way (rlaudit/heap.py)
        return _import_without_sklearn()


def _import_without_sklearn() -> bool:
    sys.modules["sklearn"] = None  # type: ignore[assignment]
    try:
        __import__(SKLEARN_USER)
    except ImportError:
        hidden = False
    else:
        hidden = True
    finally:
        if "sklearn" in sys.modules and sys.modules["sklearn"] is None:
            del sys.modules["sklearn"]
    if not hidden:  # it needed scikit-learn after all: the truth, and the module, again
        from transformers.utils import import_utils

        import_utils.is_sklearn_available.cache_clear()
        __import__(SKLEARN_USER)
    return hidden
