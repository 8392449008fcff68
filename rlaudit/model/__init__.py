"""rlaudit.model: tiny HF models and tokenizer built with no downloads, and loading model folders.

Names are resolved lazily so that ``import rlaudit.model`` stays cheap and
``python -m rlaudit.model.tiny`` does not import its own module twice.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "build_tokenizer": "tiny", "build_tiny_model": "tiny", "save_snapshot": "tiny",
    "tiny_config": "tiny",
    "load_model": "load", "load_tokenizer": "load", "snapshot_id": "load",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
