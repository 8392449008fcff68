"""The audit limits on the sizes in a scenario that drive work or memory, checked on load, and
one name per scenario.

The limits are the ``limit`` end of each key's row in :data:`rlaudit.config_bounds.BOUNDS`
(its other end, the range a value must be in at all, is checked as the config is built):
validation elsewhere makes each size well-formed (an integer >= 1, a layout that fits the
model), and without an upper end ``steps: 10**30`` replayed for as long as anyone let it,
``ppo_epochs: 10**12`` looped inside validation and a huge context-parallel size or padding
count ran for minutes before failing. Exceeding one is an InputError naming the key and the
limit.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable

from rlaudit.config import Config
from rlaudit.config_bounds import BOUNDS, SCENARIO, numeric_fields
from rlaudit.errors import InputError

#: ranks one backend layout may start (the product of its sizes): a multi-node Ray cluster of
#: 32 nodes x 8 GPUs; a local run starts one process per rank
MAX_WORLD = 256


def limits() -> dict[str, tuple[int, str]]:
    """Scenario key (``steps``, ``config.actor.ppo_epochs``, ...) -> (limit, what it counts) of
    every row of :data:`~rlaudit.config_bounds.BOUNDS` with a ``limit``."""
    out = {key: (row.limit, row.limit_why) for key, row in BOUNDS[SCENARIO].items()
           if row.limit is not None}
    for cls, name, key, _ in numeric_fields(Config):
        row = BOUNDS[cls.__name__][name]
        if row.limit is not None:
            out[f"config.{key}"] = (row.limit, row.limit_why)
    return out


def _value(scn, key: str):
    if key == "steps":
        return scn.steps
    node = scn.config
    for part in key.split(".")[1:]:
        node = getattr(node, part, None)
    return node


def size_problems(scn) -> list[InputError]:
    """The sizes of loaded scenario ``scn`` above their limits (empty when all are within)."""
    src = str(scn.path)
    out = []
    for key, (limit, why) in limits().items():
        v = _value(scn, key)
        if isinstance(v, int) and v > limit:
            out.append(InputError(f"{v} is above the limit of {limit} ({why}); a larger "
                                  "value is a training run, not an audit", source=src, key=key))
    for backend, layout in scn.backends.items():
        world = 1
        for size in layout.values():
            world *= size
        if world > MAX_WORLD:
            out.append(InputError(f"the layout {layout} starts {world} ranks, above the limit "
                                  f"of {MAX_WORLD}", source=src, key=f"backends.{backend}"))
    return out


def check_sizes(scn) -> None:
    """Raise the first of :func:`size_problems` (on load: nothing may run past a limit)."""
    problems = size_problems(scn)
    if problems:
        raise problems[0]


def check_unique_names(paths: Iterable[Path], *, key: str | None = None) -> None:
    """Two scenario files with one file name (in different folders) would share a golden and
    a report entry, and one would be skipped: refused, naming both files."""
    seen: dict[str, Path] = {}
    for p in paths:
        other = seen.setdefault(p.stem, p)
        if other != p:
            raise InputError(f"two scenario files named {p.stem!r}: {other} and {p}; rename one "
                             "(the name keys its golden and its report entry)",
                             source=str(p), key=key or "name")


def duplicate_names(scenarios) -> list[InputError]:
    """Loaded scenarios that share a name (``name:`` can differ from the file's): they would
    write one golden and one report entry."""
    first: dict[str, Path] = {}
    out = []
    for scn in scenarios:
        other = first.setdefault(scn.name, scn.path)
        if other != scn.path:
            out.append(InputError(f"two scenarios named {scn.name!r}: {other} and {scn.path}; "
                                  "rename one (the name keys its golden and its report entry)",
                                  source=str(scn.path), key="name"))
    return out
