"""Nested dataclasses to and from plain dicts (YAML/JSON), strictly: :func:`from_dict` rejects
unknown keys and badly typed values naming the file and the dotted key, so a typo in a config or
scenario file is an input error (exit 2), never a silently ignored setting."""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, Literal, Mapping

from rlaudit.errors import InputError


def from_dict(cls, data: Mapping[str, Any] | None, *, source: str | None = None, prefix: str = ""):
    """Build dataclass ``cls`` from ``data`` (nested dicts). Unknown keys and values of the wrong
    type raise :class:`InputError` naming ``source`` and the dotted key."""
    data = {} if data is None else data
    if not isinstance(data, Mapping):
        raise InputError(f"expected a mapping, got {type(data).__name__}", source=source,
                         key=prefix.rstrip(".") or None)
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in data.items():
        dotted = f"{prefix}{key}"
        if key not in fields:
            raise InputError(f"unknown key; valid keys here: {', '.join(sorted(fields))}",
                             source=source, key=dotted)
        kwargs[key] = _coerce(hints[key], value, source=source, key=dotted)
    return cls(**kwargs)


def to_dict(obj) -> dict[str, Any]:
    """Nested plain dict of a config dataclass (tuples become lists: YAML/JSON friendly)."""
    def conv(v):
        if dataclasses.is_dataclass(v):
            return {f.name: conv(getattr(v, f.name)) for f in dataclasses.fields(v)}
        if isinstance(v, tuple):
            return [conv(x) for x in v]
        return v
    return conv(obj)


def flatten(d: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"actor": {"optim": {"lr": 1}}} -> {"actor.optim.lr": 1}."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, Mapping):
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _type_name(tp) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _coerce(tp, value, *, source, key):
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value, source=source, prefix=f"{key}.")
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return _coerce(a, value, source=source, key=key)
            except InputError as e:
                errors.append(e)
        raise InputError(f"expected {_type_name(tp)}, got {value!r}", source=source, key=key)
    if origin is Literal:
        allowed = typing.get_args(tp)
        if value not in allowed:
            raise InputError(f"expected one of {list(allowed)}, got {value!r}", source=source,
                             key=key)
        return value
    if origin is tuple and len(typing.get_args(tp)) == 2 and typing.get_args(tp)[1] is Ellipsis:
        item = typing.get_args(tp)[0]
        if not isinstance(value, (list, tuple)):
            raise InputError(f"expected a list, got {value!r}", source=source, key=key)
        return tuple(_coerce(item, v, source=source, key=f"{key}[{i}]")
                     for i, v in enumerate(value))
    if origin is tuple:
        args = typing.get_args(tp)
        if not isinstance(value, (list, tuple)) or len(value) != len(args):
            raise InputError(f"expected a list of {len(args)} values, got {value!r}",
                             source=source, key=key)
        return tuple(_coerce(a, v, source=source, key=key) for a, v in zip(args, value))
    if tp is bool:
        if not isinstance(value, bool):
            raise InputError(f"expected true/false, got {value!r}", source=source, key=key)
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise InputError(f"expected an integer, got {value!r}", source=source, key=key)
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            # YAML reads 1e-6 (no dot) as a string: accept numeric strings
            if isinstance(value, str):
                try:
                    return float(value)
                except ValueError:
                    pass
            raise InputError(f"expected a number, got {value!r}", source=source, key=key)
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise InputError(f"expected a string, got {value!r}", source=source, key=key)
        return value
    if tp is Any:
        return value
    raise TypeError(f"config type {tp} of {key} is not supported")  # a bug in this module
