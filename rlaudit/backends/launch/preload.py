"""Imported once by the forkserver that CPU warm pools fork their ranks from (see ``_start``).

Each rank of a freshly spawned process imports torch, transformers and megatron-core itself:
about 4-5 CPU-seconds per rank, 16-18 for the four ranks of one scenario's FSDP and Megatron
groups on a 2-core machine -- more than the replays themselves. The forkserver pays it once;
every rank forked from it starts with these modules loaded (copy-on-write), and only imports what
is specific to its task.

What may happen here, and what may not:

- imports only (under ``rlaudit.heap.importing(collect=False)``: a freeze of what they built, at
  the end, without a collection first): no tensor is computed, no thread pool started, no CUDA
  touched (a forked child cannot use a CUDA context or an OpenMP pool its parent created; CUDA
  pools are spawned);
- third-party chatter (megatron's "Transformer Engine and Apex are not installed" warnings)
  goes nowhere unless ``$RLAUDIT_PRELOAD_LOG`` names a file (set it to debug the preload): this
  process's output is never the user's;
- a module that fails to import is noted in that log and skipped: the rank then imports it
  itself, as a spawned rank would, and reports any error in its own log.

The forked rank resets what matters before it runs anything (``_worker.setup_process``: its own
process group, log file, environment; then torch's thread count).
"""

from __future__ import annotations

import os
import sys
import time
import traceback

from rlaudit import switches

#: What the ranks of rlaudit's FSDP and Megatron backends import, outermost first. Listing the
#: lazily loaded model and megatron modules is what makes the preload worth it: ``import
#: transformers`` alone defers most of the cost to the first model load. ``module:function``:
#: import the module, then call the function (no arguments).
MODULES = (
    "torch",
    "torch.distributed",
    "torch.distributed.fsdp",
    "torch.distributed.device_mesh",
    "torch.distributed.tensor",
    "transformers",
    "rlaudit.model.hf_import:import_model_code",  # the model code without scikit-learn
    "transformers.models.auto.modeling_auto",
    "transformers.models.auto.tokenization_auto",
    "transformers.models.qwen2.modeling_qwen2",
    "transformers.models.llama.modeling_llama",
    "transformers.generation",
    "safetensors.torch",
    "rlaudit.backends.launch.pool_worker",
    "rlaudit.backends.reference",
    "rlaudit.backends.replay",
    "rlaudit.backends.fsdp",
    "rlaudit.model.load",
    "rlaudit.update.step",
    "rlaudit.backends.megatron.imports:import_megatron",  # megatron.core, compile deferred
    "megatron.core.parallel_state",
    "megatron.core.tensor_parallel",
    "megatron.core.tensor_parallel.random",
    "megatron.core.models.gpt",
    "megatron.core.optimizer",
    "megatron.core.distributed",
    "megatron.core.pipeline_parallel",
    "rlaudit.backends.megatron.backend",
    "rlaudit.backends.megatron.compat",
    "rlaudit.backends.megatron.convert",
    "rlaudit.backends.megatron.context",
    "rlaudit.backends.megatron.model",
    "rlaudit.backends.megatron.vocab_parallel",
)


def _redirect_output() -> None:
    path = switches.preload_log()
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    except OSError:
        fd = os.open(os.devnull, os.O_WRONLY)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def preload(modules=MODULES) -> dict[str, str]:
    """Import ``modules``; returns the ones that failed, with the error."""
    failed = {}
    for name in modules:
        try:
            module, _, function = name.partition(":")
            __import__(module)  # (not importlib: a profiler that wraps __import__ sees it)
            if function:
                getattr(sys.modules[module], function)()
        except BaseException as exc:  # noqa: BLE001 - the rank imports it again and reports
            failed[name] = f"{type(exc).__name__}: {exc}"
            sys.stderr.write(f"[rlaudit preload] {name}: {failed[name]}\n"
                             f"{traceback.format_exc(limit=3)}")
    return failed


if switches.preload_active():  # only inside the forkserver (see start.py)
    _redirect_output()
    t0 = time.perf_counter()
    import warnings

    # what is imported here lives as long as every rank forked from this process: no
    # collection on the way, and a freeze at the end without one -- this process has done
    # nothing but import (rlaudit/heap.py)
    from rlaudit.heap import importing

    with warnings.catch_warnings(), importing(collect=False):
        warnings.simplefilter("ignore")
        FAILED = preload()
    sys.stderr.write(f"[rlaudit preload] {len(MODULES) - len(FAILED)} modules in "
                     f"{time.perf_counter() - t0:.1f} s\n")
    sys.stderr.flush()
    # the switch was for this process: a forked rank's environment is then the launcher's as it
    # was when the forkserver started (what a spawned rank gets), and a process a rank starts
    # that imports this module does not take itself for a forkserver
    os.environ.pop(switches.PRELOAD_ACTIVE, None)
