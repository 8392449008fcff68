"""The reference backend replayed in a one-rank warm pool (``ReferenceBackend.replay_in_pool``,
what the executors do beside multi-rank backends): the same runs as in-process, bit for bit; an
InputError in the rank is raised as one, with its message; any other failure stays the group's
RankFailure."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from rlaudit.backends import memo
from rlaudit.backends.base import ReplayRequest, Variant
from rlaudit.backends.launch.pool import warm_pools
from rlaudit.backends.reference import POOL, ReferenceBackend
from rlaudit.config import load_config
from rlaudit.data.io import load_rollout
from rlaudit.errors import InputError, RankFailure

ROOT = os.path.join(os.path.dirname(__file__), "..", "..", "scenarios")
MODEL = os.path.abspath(os.path.join(ROOT, "models", "qwen2-tiny-short"))
ROLLOUT = os.path.abspath(os.path.join(ROOT, "rollouts", "short-ref.safetensors"))


def _request(lr=0.01, **kw) -> ReplayRequest:
    cfg = load_config({"rollout": {"n": 4, "response_length": 12},
                       "actor": {"ppo_mini_batch_size": 2, "ppo_micro_batch_size_per_gpu": 1,
                                 "calculate_entropy": True, "optim": {"name": "adamw",
                                                                      "lr": lr}},
                       "trainer": {"dtype": "float64"}})
    batch = load_rollout(ROLLOUT)
    return ReplayRequest(model=MODEL, variants=[Variant("a", cfg, batch, steps=2),
                                                Variant("b", cfg, batch, steps=1)],
                         dtype="float64", **kw)


def _untimed(steps):
    return [{k: v for k, v in s.items() if not k.startswith("timing/")} for s in steps]


def _assert_same(a, b) -> None:
    assert _untimed(a.steps) == _untimed(b.steps)
    assert a.tokens.keys() == b.tokens.keys()
    for k in a.tokens:
        assert torch.equal(a.tokens[k], b.tokens[k]), k
    assert len(a.params) == len(b.params) > 0
    for x, y in zip(a.params, b.params):
        assert torch.equal(x, y)
    assert a.micro_log == b.micro_log
    assert torch.equal(a.params_initial, b.params_initial)
    assert a.param_norms == b.param_norms and a.param_names == b.param_names
    assert a.inputs_unchanged == b.inputs_unchanged


@pytest.mark.slow
def test_a_pooled_replay_is_the_in_process_replay_bit_for_bit():
    request, other = _request(), _request(lr=0.02)
    torch.set_num_threads(1)
    with memo.disabled():
        here, other_here = ReferenceBackend().replay(request), ReferenceBackend().replay(other)
    with warm_pools() as pools:
        there = ReferenceBackend().replay_in_pool(request, threads=1)
        # the same warm rank after another task (a different config: not in its memo)
        other_there = ReferenceBackend().replay_in_pool(other, threads=1)
        assert pools.stats["tasks"] == 2 and pools.stats["spawned"] == 1
        assert [key[0] for key in pools._pools] == [POOL]
    assert list(there) == list(here) == list(other_there) == ["a", "b"]
    for name in here:
        _assert_same(there[name], here[name])
        _assert_same(other_there[name], other_here[name])
        assert len(here[name].steps) == {"a": 2, "b": 1}[name]
    assert other_here["a"].steps[0]["actor/lr"] != here["a"].steps[0]["actor/lr"]


def test_an_input_error_in_the_rank_is_raised_as_the_in_process_one(tmp_path):
    request = dataclasses.replace(_request(), model=str(tmp_path / "no-such-model"))
    with pytest.raises(InputError) as here:
        ReferenceBackend().replay(request)
    with warm_pools():
        with pytest.raises(InputError) as there:
            ReferenceBackend().replay_in_pool(request, threads=1)
    assert str(there.value) == str(here.value) and "no-such-model" in str(there.value)
    assert isinstance(there.value.__cause__, RankFailure)  # where it came from, kept


def test_any_other_failure_in_the_rank_stays_a_rank_failure():
    request = _request()
    broken = dataclasses.replace(request, variants=[Variant("a", request.variants[0].config,
                                                            "not a batch", steps=1)])
    with warm_pools():
        with pytest.raises(RankFailure) as raised:
            ReferenceBackend().replay_in_pool(broken, threads=1)
    assert not isinstance(raised.value, InputError)
    assert "rank 0 raised" in str(raised.value)
