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
the hidden import; it then answers "not installed" in this process, consistently, to the only
code that asks: those losses and a few vision and audio models (segmentation, detection, pose,
FNet, Pop2Piano), none of which an RL trainer of language models loads.
:func:`import_model_code` imports that module the same way after the first.
"""

from __future__ import annotations

import sys

from rlaudit.heap import importing

#: the transformers module that imports scikit-learn, and transformers' cached check of it
SKLEARN_USER = "transformers.generation.candidate_generator"
SKLEARN_CHECK = "is_sklearn_available"
#: the transformers module whose imports bring SciPy (the loss registry), and the check
SCIPY_USER = "transformers.modeling_utils"
SCIPY_CHECK = "is_scipy_available"


def import_model_code() -> bool:
    """Import :data:`SKLEARN_USER` with scikit-learn hidden, then :data:`SCIPY_USER` with SciPy
    hidden, each if that still saves anything. Returns whether scikit-learn stayed hidden (False:
    imported with it, or nothing to do)."""
    if all(module in sys.modules or package in sys.modules
           for package, module in (("sklearn", SKLEARN_USER), ("scipy", SCIPY_USER))):
        return False

    with importing():  # most of transformers: no full collections on the way (rlaudit/heap.py)
        hidden = _import_without_sklearn()
        _import_without_scipy()
        return hidden


def _import_without_sklearn() -> bool:
    # transformers has not asked yet (the module's import asks first): nothing to drop
    return _import_hiding("sklearn", SKLEARN_USER, SKLEARN_CHECK, ask_again=False)


def _import_without_scipy() -> bool:
    # transformers has asked by the end of its own import: its cached answer is dropped first
    return _import_hiding("scipy", SCIPY_USER, SCIPY_CHECK, ask_again=True)


def _import_hiding(package: str, module: str, check: str, *, ask_again: bool) -> bool:
    """Import ``module`` with ``package`` hidden; True when it stayed hidden. ``check``:
    transformers' cached "is it installed" function, dropped first with ``ask_again``; when the
    import fails hidden, the answer is dropped and the module imported again with nothing
    hidden. Nothing is hidden when the module or the package is loaded already, or (with
    ``ask_again``) transformers has no such cached check (another release)."""
    if module in sys.modules or package in sys.modules:
        return False
    # lazy: transformers: 2 s import, only where a model is built or loaded
    from transformers.utils import import_utils

    cached = getattr(import_utils, check, None)
    if ask_again:
        if not hasattr(cached, "cache_clear"):
            return False
        cached.cache_clear()
    sys.modules[package] = None  # type: ignore[assignment]
    try:
        __import__(module)
    except ImportError:
        hidden = False
    else:
        hidden = True
    finally:
        if package in sys.modules and sys.modules[package] is None:
            del sys.modules[package]
    if not hidden:  # it needed the package after all: the truth, and the module, again
        if hasattr(cached, "cache_clear"):
            cached.cache_clear()
        __import__(module)
    return hidden
