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

SciPy the same way: ``transformers.modeling_utils`` (every model class's base) imports the loss
registry, whose DETR-family object-detection losses import ``scipy.optimize`` (for
``linear_sum_assignment``) when SciPy is installed -- 0.3-0.35 s here, and nothing else in a
forkserver's preload or a reference run imports SciPy. transformers has asked whether SciPy is
installed by the end of ``import transformers`` already, so its cached answer is dropped before
the hidden import (it then answers "not installed" in this process, consistently: those losses
would say so). :func:`import_model_code` imports that module the same way after the first.
"""

from __future__ import annotations

import sys

#: the transformers module that imports scikit-learn
SKLEARN_USER = "transformers.generation.candidate_generator"
#: the transformers module whose imports bring SciPy (the loss registry), and transformers' cached
#: check of it
SCIPY_USER = "transformers.modeling_utils"
SCIPY_CHECK = "is_scipy_available"


def import_model_code() -> bool:
    """Import :data:`SKLEARN_USER` with scikit-learn hidden, if that still saves anything.
    Returns whether it stayed hidden (False: imported with scikit-learn, or nothing to do)."""
    if SKLEARN_USER in sys.modules or "sklearn" in sys.modules:
        return False
    from rlaudit.heap import importing

    with importing():  # most of transformers: no full collections on the way (rlaudit/heap.py)
        hidden = _import_without_sklearn()
        _import_without_scipy()
        return hidden


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


def _import_without_scipy() -> bool:
    """Import :data:`SCIPY_USER` with SciPy hidden and transformers' cached "installed" answer
    dropped; True when it stayed hidden. Nothing is hidden when the module or SciPy is loaded
    already, or transformers has no such check (another release)."""
    if SCIPY_USER in sys.modules or "scipy" in sys.modules:
        return False
    from transformers.utils import import_utils

    check = getattr(import_utils, SCIPY_CHECK, None)
    if not hasattr(check, "cache_clear"):
        return False
    check.cache_clear()
    sys.modules["scipy"] = None  # type: ignore[assignment]
    try:
        __import__(SCIPY_USER)
    except ImportError:
        hidden = False
    else:
        hidden = True
    finally:
        if "scipy" in sys.modules and sys.modules["scipy"] is None:
            del sys.modules["scipy"]
    if not hidden:  # it needed SciPy after all: the truth, and the module, again
        check.cache_clear()
        __import__(SCIPY_USER)
    return hidden
