"""Toy tasks with rule rewards that a tiny byte-level model can visibly learn on CPU in minutes.

A task makes prompts (deterministically from a seed) and scores a response text with a rule.

- ``digits``: the prompt is a few random lowercase letters; the score is the fraction of the
  response's characters that are ASCII digits (the response must be non-empty). A random-init
  byte model emits digits ~4% of the time; RL raises it quickly.
- ``echo``: the prompt is ``"<letters>:"``; the score is the fraction of response characters equal
  to the prompt's first letter. Needs attention to the prompt, so it is slower to learn.
- ``short``: the score is ``1 - |len - 4| / 12`` (clipped at 0) for a response of ``len``
  characters: the model must learn to emit EOS early. Gives rollouts with varied lengths, which
  length-sensitive losses, token budgets and the overlong penalty need.
"""

from __future__ import annotations

import random
import string
from dataclasses import dataclass
from typing import Callable

from rlaudit.algo.registry import Registry


@dataclass(frozen=True)
class Task:
    name: str
    make_prompt: Callable[[random.Random], str]
    score: Callable[[str, str], float]
    doc: str


TASKS: Registry = Registry("task")


def _letters(rng: random.Random, lo: int = 3, hi: int = 6) -> str:
    return "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(lo, hi)))


def _digits_score(prompt: str, response: str) -> float:
    if not response:
        return 0.0
    return sum(c in string.digits for c in response) / len(response)


def _echo_score(prompt: str, response: str) -> float:
    if not response or not prompt:
        return 0.0
    return sum(c == prompt[0] for c in response) / len(response)


#: target length and length scale of the `short` task
SHORT_TARGET, SHORT_SCALE = 4, 12.0


def _short_score(prompt: str, response: str) -> float:
    return max(1.0 - abs(len(response) - SHORT_TARGET) / SHORT_SCALE, 0.0)


for _task in (
    Task("digits", _letters, _digits_score, "fraction of response characters that are digits"),
    Task("echo", lambda rng: _letters(rng) + ":", _echo_score,
         "fraction of response characters equal to the prompt's first letter"),
    Task("short", lambda rng: _letters(rng) + "=", _short_score,
         "1 - |response length - 4| / 12: learn to stop early"),
):
    TASKS.register(_task.name)(_task)


def get_task(name: str, *, source: str | None = None) -> Task:
    return TASKS.get(name, source=source, key="task")


def prompts_for_step(task: Task, *, seed: int, step: int, gen_index: int, count: int) -> list[str]:
    """Deterministic prompts for (seed, step, generation batch): a resumed run sees the same ones."""
    rng = random.Random(f"{seed}:{step}:{gen_index}")
    return [task.make_prompt(rng) for _ in range(count)]
