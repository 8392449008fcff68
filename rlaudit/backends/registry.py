"""Backends by name. Heavy backends are imported only when asked for."""

from __future__ import annotations

import importlib

from rlaudit.errors import UnknownNameError

_BACKENDS = {
    "reference": ("rlaudit.backends.reference", "ReferenceBackend"),
    "fsdp": ("rlaudit.backends.fsdp", "FSDPBackend"),
    "megatron": ("rlaudit.backends.megatron.backend", "MegatronBackend"),
}


def backend_names() -> list[str]:
    return list(_BACKENDS)


class _Unavailable:
    def __init__(self, name: str, why: str):
        self.name, self._why = name, why

    def available(self):
        return False, self._why

    def replay(self, request):  # never called: the engine checks available() first
        raise RuntimeError(self._why)


def get_backend(name: str):
    if name not in _BACKENDS:
        raise UnknownNameError("backend", name, list(_BACKENDS))
    module, cls = _BACKENDS[name]
    try:
        return getattr(importlib.import_module(module), cls)()
    except ImportError as e:
        return _Unavailable(name, f"cannot import {module}: {e}")


def catalogue_section() -> list[dict]:
    """The "backends" section of rlaudit.catalogue's name cache: each backend's name and whether
    it can run here (and why not)."""
    out = []
    for name in backend_names():
        ok, why = get_backend(name).available()
        out.append({"name": name, "available": ok, "why": why})
    return out
