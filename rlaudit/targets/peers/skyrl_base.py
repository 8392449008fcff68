"""Importing SkyRL (pinned ``skyrl==0.4.0``) on Python 3.11, and its response layout: what the
stage adapter (skyrl.py) and the training step (skyrl_train.py) share.

SkyRL 0.4.0 declares Python >= 3.12; on 3.11 package ``__init__`` modules are skipped
(:func:`import_skyrl`): ``skyrl.backends`` (imports the Tinker engine, whose pydantic models need
3.12's ``typing.TypedDict``) and ``skyrl.train.dataset`` (imports Hugging Face ``datasets``); the
modules used here import nothing from either.
"""

from __future__ import annotations

import functools
import importlib
import os
import sys
import types
from types import SimpleNamespace

import torch

from rlaudit.errors import InputError

#: the pinned release the SkyRL adapter was written against (docs/peers.md)
PINNED = "0.4.0"


def _skip_package_init(name: str) -> None:
    """Register package ``name`` (its parent imported) without running its ``__init__``."""
    if name in sys.modules:
        return
    parent, _, leaf = name.rpartition(".")
    base = os.path.dirname(sys.modules[parent].__file__)
    pkg = types.ModuleType(name)
    pkg.__path__ = [os.path.join(base, leaf)]
    pkg.__package__ = name
    sys.modules[name] = pkg


@functools.lru_cache(maxsize=None)
def import_skyrl(*, trainer: bool = False) -> SimpleNamespace:
    """SkyRL's modules this adapter calls (InputError when SkyRL is not importable).
    ``trainer``: ``skyrl.train.dataset`` is imported for real (Hugging Face ``datasets`` from the
    peer directory), as ``skyrl.train.trainer`` imports ``PromptDataset`` from it (skyrl_train;
    in a fresh process, before any call without it). On 3.11 ``skyrl.train.generators``'
    ``__init__`` is skipped too (below)."""
    try:
        import skyrl  # lazy: SkyRL is optional, imported when audited
        if sys.version_info < (3, 12):
            _skip_package_init("skyrl.backends")
            import skyrl.train  # lazy: SkyRL is optional, imported when audited
            if not trainer:
                _skip_package_init("skyrl.train.dataset")
            # its __init__ imports the VLM generator, whose renderer imports the Tinker types
            # (3.12's TypedDict); the trainer imports only generators.base and .utils
            _skip_package_init("skyrl.train.generators")
        mods = {k: importlib.import_module(f"skyrl.{v}") for k, v in {
            "ppo": "backends.skyrl_train.utils.ppo_utils",
            "workers": "backends.skyrl_train.workers.worker_utils",
            "dispatch": "backends.skyrl_train.distributed.dispatch",
            "preprocess": "train.dataset.preprocess",
            "config": "train.config"}.items()}
    except ImportError as e:
        raise InputError(f"SkyRL is not importable ({e}); install it with `make peers` "
                         f"(requirements/peers/skyrl-{PINNED}.txt, docs/peers.md)",
                         key="--target") from None
    from loguru import logger  # lazy: SkyRL is optional, imported when audited
    logger.disable("skyrl")     # its per-call warnings (e.g. "GSPO recommends sequence_mean")
    return SimpleNamespace(version=getattr(skyrl, "__version__", "?"), **mods)


# ---- layout ----------------------------------------------------------------------------------

def shift(x: torch.Tensor, lengths: torch.Tensor, *, to_right: bool) -> torch.Tensor:
    """Rotate each row of ``x`` [B, R, ...] so its first ``lengths[i]`` entries end at the right
    edge (``to_right``; SkyRL's layout) or back to the left. A permutation within each row, so
    every value (masked ones too) reaches SkyRL at a position with the same mask status.
    Differentiable (gather)."""
    b, r = x.shape[:2]
    offset = (r - lengths.to(torch.int64)).unsqueeze(1)
    cols = torch.arange(r).unsqueeze(0)
    idx = (cols - offset) % r if to_right else (cols + offset) % r
    idx = idx.view(b, r, *([1] * (x.dim() - 2))).expand_as(x)
    return x.gather(1, idx)


__all__ = ["PINNED", "import_skyrl", "shift"]
