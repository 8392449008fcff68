"""Toy tasks of the reference trainer: rule scores by hand-worked examples; deterministic prompts
per (seed, step, generation batch)."""

from __future__ import annotations

import os
import string
import subprocess
import sys

import pytest

from rlaudit.errors import InputError, UnknownNameError
from rlaudit.rollout.tasks import TASKS, get_task, prompts_for_step


@pytest.mark.parametrize("prompt,response,want", [
    ("abc", "a1b2", 0.5),          # 2 digits of 4 characters
    ("abc", "0123456789", 1.0),
    ("abc", "xyz", 0.0),
    ("abc", "", 0.0),              # an empty response scores 0, not 0/0
    ("abc", "7", 1.0),
    ("abc", "1 2 ", 0.5),          # spaces count as characters
])
def test_digits_score(prompt, response, want):
    assert get_task("digits").score(prompt, response) == pytest.approx(want, abs=1e-15)


@pytest.mark.parametrize("prompt,response,want", [
    ("xyz:", "xxa", 2 / 3),        # prompt's first letter is x
    ("xyz:", "yyy", 0.0),          # other prompt letters do not count
    ("xyz:", "x", 1.0),
    ("xyz:", "", 0.0),
    ("", "xx", 0.0),               # no prompt, no first letter
    ("ab:", "aAaA", 0.5),          # case-sensitive
])
def test_echo_score(prompt, response, want):
    assert get_task("echo").score(prompt, response) == pytest.approx(want, abs=1e-15)


@pytest.mark.parametrize("length,want", [
    (4, 1.0),                      # the target length
    (3, 11 / 12), (5, 11 / 12),    # symmetric around the target
    (0, 8 / 12),                   # 1 - 4/12
    (10, 0.5),                     # 1 - 6/12
    (16, 0.0),                     # 1 - 12/12
    (25, 0.0),                     # clipped at 0, never negative
])
def test_short_score(length, want):
    assert get_task("short").score("ab=", "z" * length) == pytest.approx(want, abs=1e-15)


def test_unknown_task_lists_the_valid_ones():
    with pytest.raises(UnknownNameError) as e:
        get_task("digitz", source="cfg.yaml")
    msg = str(e.value)
    assert "cfg.yaml" in msg and "task" in msg and "digitz" in msg
    for name in ("digits", "echo", "short"):
        assert name in msg
    assert isinstance(e.value, InputError)
    assert set(TASKS.names()) >= {"digits", "echo", "short"}


def test_prompt_shapes():
    for name, suffix in (("digits", ""), ("echo", ":"), ("short", "=")):
        prompts = prompts_for_step(get_task(name), seed=3, step=0, gen_index=0, count=50)
        assert len(prompts) == 50
        for p in prompts:
            body = p[:len(p) - len(suffix)] if suffix else p
            assert p.endswith(suffix)
            assert 3 <= len(body) <= 6 and set(body) <= set(string.ascii_lowercase), p
        assert len(set(prompts)) > 40  # random, not one prompt repeated


def test_prompts_are_a_function_of_seed_step_and_gen_index():
    task = get_task("digits")
    args = dict(seed=7, step=3, gen_index=1, count=8)
    first = prompts_for_step(task, **args)
    assert prompts_for_step(task, **args) == first
    for change in ({"seed": 8}, {"step": 4}, {"gen_index": 2}, {"gen_index": 0}):
        assert prompts_for_step(task, **{**args, **change}) != first, change
    # a longer request extends the same stream: the first prompts do not move
    assert prompts_for_step(task, **{**args, "count": 12})[:8] == first
    assert prompts_for_step(task, **{**args, "count": 0}) == []


def test_prompts_do_not_depend_on_the_process_hash_seed():
    """A resumed run is a new process: its prompts must not depend on PYTHONHASHSEED."""
    code = ("from rlaudit.rollout.tasks import get_task, prompts_for_step;"
            "print('|'.join(prompts_for_step(get_task('echo'), seed=5, step=2, gen_index=1, "
            "count=6)))")
    outs = []
    for hash_seed in ("1", "12345"):
        env = {**os.environ, "PYTHONHASHSEED": hash_seed}
        outs.append(subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                                   text=True, check=True, timeout=120).stdout.strip())
    here = "|".join(prompts_for_step(get_task("echo"), seed=5, step=2, gen_index=1, count=6))
    assert outs == [here, here]
