"""Errors a user can cause, and the exit codes they map to.

Exit codes (the whole CLI): 0 all checks passed, 1 an invariant or golden comparison failed,
2 bad input or usage (malformed scenario, truncated rollout file, unknown config key, ...).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

EXIT_OK = 0
EXIT_CHECK_FAILED = 1
EXIT_BAD_INPUT = 2
#: Ctrl-C (what had finished is still reported)
EXIT_INTERRUPTED = 130


class RlauditError(Exception):
    """Base class of every error rlaudit raises on purpose."""

    exit_code = EXIT_BAD_INPUT


class InputError(RlauditError, ValueError):
    """Bad input: names where it came from (``source``: a file or argument), the offending ``key``
    (a dotted config key or a tensor field) and what was expected."""

    def __init__(self, message: str, *, source: str | None = None, key: str | None = None):
        self.source = source
        self.key = key
        where = ": ".join(p for p in (source, key) if p)
        super().__init__(f"{where}: {message}" if where else message)


class UnknownNameError(InputError, KeyError):
    """A name looked up in a registry (an advantage estimator, a KL type, ...) does not exist."""

    def __init__(self, kind: str, name: object, valid: list[str], *, source: str | None = None,
                 key: str | None = None):
        self.kind = kind
        self.name = name
        self.valid = sorted(valid)
        super().__init__(f"unknown {kind} {name!r}; valid: {', '.join(self.valid)}",
                         source=source, key=key)

    def __str__(self) -> str:  # KeyError would repr() the message
        return self.args[0]


class CheckFailed(RlauditError, AssertionError):
    """An invariant or golden comparison did not hold."""

    exit_code = EXIT_CHECK_FAILED


class RankFailure(RlauditError, RuntimeError):
    """A rank of a multi-process group raised, died, or did not finish within its timeout."""

    exit_code = EXIT_CHECK_FAILED


class InputErrors(InputError):
    """Several input problems found together (the validation pass of an invocation), each an
    :class:`InputError` naming its file and key; the message lists them all, one per line.
    :func:`raise_problems` raises a lone problem as itself."""

    def __init__(self, problems: list[InputError], *, header: str = "input problems"):
        self.problems = list(problems)
        lines = [f"{len(self.problems)} {header}:"] + [f"  {p}" for p in self.problems]
        super().__init__("\n".join(lines))


def raise_problems(problems: list[InputError], *, header: str = "input problems") -> None:
    """Nothing if ``problems`` is empty; the problem itself if there is one; else InputErrors."""
    if len(problems) == 1:
        raise problems[0]
    if problems:
        raise InputErrors(problems, header=header)


@dataclass
class Problems:
    """Collects InputErrors; identical ones (a rollout shared by scenarios) are kept once."""

    items: list[InputError] = field(default_factory=list)

    def add(self, message: str, *, source: str | None, key: str | None) -> None:
        self.take(InputError(message, source=source, key=key))

    def take(self, err: InputError) -> None:
        if str(err) not in {str(p) for p in self.items}:
            self.items.append(err)

    def attempt(self, fn: Callable, *args, wrap: tuple[str, str] | None = None, **kw):
        """``fn(*args, **kw)``, or None with its InputError recorded (``wrap=(source, key)``:
        recorded under that file and key, the original message kept)."""
        try:
            return fn(*args, **kw)
        except InputError as e:
            if wrap is None:
                self.take(e)
            else:
                self.add(str(e), source=wrap[0], key=wrap[1])
            return None
