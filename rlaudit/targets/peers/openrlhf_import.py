"""Importing OpenRLHF's real modules on a CPU environment without flash-attn.

OpenRLHF's modules that rlaudit calls (``models.utils``, ``models.loss``,
``trainer.ppo_utils.experience_maker``, ``utils.seqlen_balancing``) are plain torch, but their
imports reach flash-attn, a CUDA-only package built from source: ``experience_maker`` imports the
Ray launcher, which imports ``openrlhf.models.Actor``, whose ``ring_attn_utils`` imports
``flash_attn.bert_padding`` and ``flash_attn.utils.distributed`` at module level. Nothing rlaudit
calls reaches those names (they serve ring attention and packed samples in the actor's forward).

So, only while OpenRLHF's modules are first imported, and only when flash-attn is not installed,
``flash_attn`` and those two submodules are placeholders whose every attribute is a function that
raises (:class:`FlashAttnAbsent`); they leave ``sys.modules`` right after, so OpenRLHF's own
``try: from flash_attn... except ImportError`` fallbacks (``log_probs_from_logits``) and
transformers' availability probes see the package absent, as it is. transformers, peft and
deepspeed are imported before the placeholders exist, so their cached probes never see them.
No OpenRLHF file is changed.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.metadata
import importlib.util
import os
import sys
import types
from types import SimpleNamespace

from rlaudit.errors import InputError

#: the flash-attn modules OpenRLHF imports at module level (models/ring_attn_utils.py)
FLASH_ATTN_MODULES = ("flash_attn", "flash_attn.bert_padding", "flash_attn.utils",
                      "flash_attn.utils.distributed")
#: rlaudit's short name -> OpenRLHF module (under ``openrlhf.``)
MODULES = {"utils": "models.utils", "loss": "models.loss",
           "maker": "trainer.ppo_utils.experience_maker",
           "experience": "trainer.ppo_utils.experience",
           "balancing": "utils.seqlen_balancing"}


class FlashAttnAbsent(RuntimeError):
    """A flash-attn function was called; it is not installed (CUDA-only)."""


def _placeholder(name: str) -> types.ModuleType:
    mod = types.ModuleType(name)
    mod.__path__ = []           # a package: its submodules resolve through sys.modules

    def missing(attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)

        def call(*args, **kwargs):
            raise FlashAttnAbsent(f"{name}.{attr}: flash-attn is not installed (CUDA-only); "
                                  f"OpenRLHF's ring attention and packed samples need it")
        return call

    mod.__getattr__ = missing
    return mod


@contextlib.contextmanager
def flash_attn_placeholders():
    """Placeholders for :data:`FLASH_ATTN_MODULES` while the block runs, when flash-attn is not
    importable; removed afterwards (nothing else ever sees them)."""
    if importlib.util.find_spec("flash_attn") is not None:
        yield
        return
    added = [n for n in FLASH_ATTN_MODULES if n not in sys.modules]
    for n in added:
        sys.modules[n] = _placeholder(n)
    try:
        yield
    finally:
        for n in added:
            sys.modules.pop(n, None)


@contextlib.contextmanager
def _cpu_accelerator():
    """DeepSpeed picks its accelerator once, at import; without CUDA it auto-detects the CPU one
    and warns on stdout (its own handler), which would corrupt ``--json``. Naming the CPU
    accelerator (``DS_ACCELERATOR``, when unset and CUDA is absent) picks the same one quietly;
    the variable is restored after the import."""
    import torch  # lazy: only to ask whether CUDA is there
    if "DS_ACCELERATOR" in os.environ or torch.cuda.is_available():
        yield
        return
    os.environ["DS_ACCELERATOR"] = "cpu"
    try:
        yield
    finally:
        os.environ.pop("DS_ACCELERATOR", None)


@functools.lru_cache(maxsize=None)
def import_openrlhf() -> SimpleNamespace:
    """OpenRLHF's modules this adapter calls, and its version (InputError when not importable)."""
    try:
        import transformers.modeling_utils  # noqa: F401  # lazy: optional peer's dependency
        import peft  # noqa: F401  # lazy: optional peer's dependency
        with _cpu_accelerator():
            import deepspeed  # noqa: F401  # lazy: optional peer's dependency
        import openrlhf  # noqa: F401  # lazy: OpenRLHF is optional, imported when audited
        with flash_attn_placeholders():
            mods = {k: importlib.import_module(f"openrlhf.{v}") for k, v in MODULES.items()}
    except ImportError as e:
        raise InputError(f"OpenRLHF is not importable ({e}); install it with `make peers` "
                         f"(requirements/peers/openrlhf-*.txt, docs/peers.md)",
                         key="--target") from None
    return SimpleNamespace(version=importlib.metadata.version("openrlhf"), **mods)
