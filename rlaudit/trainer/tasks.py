"""Toy tasks with rule rewards that a tiny byte-level model can visibly learn on CPU in minutes.

A task makes prompts (deterministically from a seed) and scores a response text with a rule.

- ``digits``: the prompt is a few random lowercase letters; the score is the fraction of the
  response's characters that are ASCII digits (the response must be non-empty). A random-init
  byte model emits digits ~4% of the time; RL raises it quickly.
- ``echo``: the prompt is ``"<letters>:"``; the score is the fraction of response characters equal
  to the prompt's first letter. Needs attention to the prompt, so it is slower to learn.
- ``count``: the score is 1 when the response (before eos) is exactly ``"aaaa"`` (length 4 of the
  letter a), else a shaped partial credit: 0.25 per leading 'a' up to 4, minus 0.25 per extra
  character. Exercises the overlong penalty and length-sensitive losses.
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


def _count_score(prompt: str, response: str) -> float:
    lead = len(response) - len(response.lstrip("a"))
    return max(min(lead, 4) * 0.25 - max(len(response) - 4, 0) * 0.25, 0.0)


for _task in (
    Task("digits", _letters, _digits_score, "fraction of response characters that are digits"),
    Task("echo", lambda rng: _letters(rng) + ":", _echo_score,
         "fraction of response characters equal to the prompt's first letter"),
    Task("count", lambda rng: _letters(rng) + "=", _count_score,
         "partial credit for answering exactly 'aaaa'"),
):
    TASKS.register(_task.name)(_task)


def get_task(name: str, *, source: str | None = None) -> Task:
    return TASKS.get(name, source=source, key="task")


def prompts_for_step(task: Task, *, seed: int, step: int, gen_index: int, count: int) -> list[str]:
    """Deterministic prompts for (seed, step, generation batch): a resumed run sees the same ones."""
    rng = random.Random(f"{seed}:{step}:{gen_index}")
    return [task.make_prompt(rng) for _ in range(count)]
