"""Upper bounds on the sizes in a scenario that drive work or memory, checked on load.

Validation elsewhere makes each size well-formed (an integer >= 1, a layout that fits the
model); nothing bounded it from above, so ``steps: 10**30`` replayed for as long as anyone
let it, ``ppo_epochs: 10**12`` looped inside validation and a huge context-parallel size or
padding count ran for minutes before failing. Each limit below is far past any real audit
scenario (rlaudit's own use at most 4 steps, 2 epochs, 4-way layouts) and near where a
replay on a fixed rollout stops being an audit and becomes a training run, so a limit hit is
a typo or a hostile file. Exceeding one is an InputError naming the key and the limit.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable

from rlaudit.errors import InputError

#: key -> (limit, why). ``steps`` and layout sizes are scenario keys; the rest under ``config.``.
LIMITS: dict[str, tuple[int, str]] = {
    "steps": (10_000, "optimizer steps replayed on one fixed rollout"),
    "config.actor.ppo_epochs": (1_000, "passes over the rollout per step"),
    "config.critic.ppo_epochs": (1_000, "passes over the rollout per step"),
    "config.actor.context_parallel_size": (1_024, "simulated ranks each sequence is split over"),
    "config.trainer.extra_padding_microbatches": (
        1_024, "padding micro-batches run on every rank, every optimizer step"),
    "config.rollout.n": (4_096, "responses per prompt"),
    "config.data.train_batch_size": (65_536, "prompts per step"),
    "config.rollout.response_length": (1_048_576, "tokens a padded response is allocated"),
    "config.rollout.prompt_length": (1_048_576, "tokens a padded prompt is allocated"),
    "config.actor.logprob_chunk_size": (
        1_048_576, "rows of logits held at once (memory ~ chunk x vocab x 5 bytes)"),
}
#: ranks one backend layout may start (the product of its sizes): a multi-node Ray cluster of
#: 32 nodes x 8 GPUs; a local run starts one process per rank
MAX_WORLD = 256


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
    for key, (limit, why) in LIMITS.items():
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
