"""Name -> function registries, keyed by the names RL users already type (verl's where they exist).

    ADV = Registry("advantage estimator")

    @ADV.register("grpo")
    def grpo(...): ...

    ADV.get("grpo")      # -> the function
    ADV.get("gpro")      # UnknownNameError: unknown advantage estimator 'gpro'; valid: gae, grpo, ...
"""

from __future__ import annotations

from typing import Callable, Generic, Iterator, TypeVar

from rlaudit.errors import UnknownNameError

F = TypeVar("F", bound=Callable)


class Registry(Generic[F]):
    def __init__(self, kind: str):
        self.kind = kind
        self._items: dict[str, F] = {}
        self._canonical: dict[str, str] = {}

    def register(self, name: str, *aliases: str) -> Callable[[F], F]:
        """Decorator: register ``fn`` under ``name`` and any ``aliases`` (alias -> same function)."""

        def deco(fn: F) -> F:
            for n in (name, *aliases):
                if n in self._items:
                    raise ValueError(f"{self.kind} {n!r} registered twice")
                self._items[n] = fn
                self._canonical[n] = name
            return fn

        return deco

    def get(self, name: str, *, source: str | None = None, key: str | None = None) -> F:
        try:
            return self._items[name]
        except (KeyError, TypeError):
            raise UnknownNameError(self.kind, name, list(self._items), source=source,
                                   key=key) from None

    def canonical(self, name: str) -> str:
        """The primary name of ``name`` (itself, or what it is an alias of)."""
        self.get(name)
        return self._canonical[name]

    def names(self, *, aliases: bool = True) -> list[str]:
        if aliases:
            return sorted(self._items)
        return sorted(set(self._canonical.values()))

    def __contains__(self, name: object) -> bool:
        return name in self._items

    def __iter__(self) -> Iterator[str]:
        return iter(self.names(aliases=False))
