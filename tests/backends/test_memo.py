"""The reference backend's in-process memo (rlaudit/backends/memo.py): a repeated CPU replay is
answered with a copy of the first, bit for bit what a fresh replay gives; anything that changes
the result (config, batch, model weights, thread count, weight noise) is a different key; callers
cannot change what is kept; CUDA, probe re-runs and disabled() blocks always replay."""

from __future__ import annotations

import dataclasses
import os
import shutil

import pytest
import torch

from rlaudit.backends import memo
from rlaudit.backends.base import ReplayRequest, Variant
from rlaudit.backends.reference import ReferenceBackend
from rlaudit.config import load_config
from rlaudit.data.io import load_rollout

ROOT = os.path.join(os.path.dirname(__file__), "..", "..", "scenarios")
MODEL = os.path.abspath(os.path.join(ROOT, "models", "qwen2-tiny-short"))
ROLLOUT = os.path.abspath(os.path.join(ROOT, "rollouts", "short-ref.safetensors"))


def _cfg(lr=0.05):
    return load_config({"rollout": {"n": 4, "response_length": 12},
                        "actor": {"ppo_mini_batch_size": 2, "ppo_micro_batch_size_per_gpu": 2,
                                  "calculate_entropy": True,
                                  "optim": {"name": "sgd", "lr": lr}},
                        "trainer": {"dtype": "float64"}})


def _request(model=MODEL, lr=0.05, batch=None, **kw):
    batch = batch if batch is not None else load_rollout(ROLLOUT)
    return ReplayRequest(model=model, variants=[Variant("v", _cfg(lr), batch, steps=1)],
                         dtype="float64", **kw)


def _untimed(steps):
    return [{k: v for k, v in s.items() if not k.startswith("timing/")} for s in steps]


def _same(a, b) -> bool:
    """Bit for bit, timings aside (a memoised run keeps the first replay's)."""
    return (_untimed(a.steps) == _untimed(b.steps) and a.tokens.keys() == b.tokens.keys()
            and all(torch.equal(a.tokens[k], b.tokens[k]) for k in a.tokens)
            and len(a.params) == len(b.params)
            and all(torch.equal(x, y) for x, y in zip(a.params, b.params))
            and a.micro_log == b.micro_log)


@pytest.fixture(autouse=True)
def _fresh_memo():
    memo.clear()
    yield
    memo.clear()


def _replay(req):
    return ReferenceBackend().replay(req)["v"]


def _fresh(req):
    with memo.disabled():
        return _replay(req)


def test_a_repeat_is_answered_from_the_memo_and_equals_a_fresh_replay():
    req = _request()
    hits = memo.stats["hits"]
    first, second = _replay(req), _replay(_request())
    assert memo.stats["hits"] == hits + 1
    fresh = _fresh(req)
    assert _same(second, fresh) and _same(first, fresh)
    assert second is not first and second.tokens["old_log_probs"] is not first.tokens["old_log_probs"]


def test_what_a_caller_does_to_its_copy_is_not_kept():
    req = _request()
    want = _fresh(req)
    for _ in range(2):                  # the replay that fills the memo, then a hit
        got = _replay(req)
        got.tokens["old_log_probs"].add_(1.0)
        got.params[0].mul_(2.0)
        got.steps[0]["actor/pg_loss"] = 123.0
        got.info["mine"] = True
    again = _replay(req)
    assert _same(again, want) and "mine" not in again.info


def test_whatever_changes_the_result_is_another_key(tmp_path):
    base = _request()
    k0 = memo.key(base, base.variants[0])
    assert k0 is not None and memo.key(_request(), base.variants[0]) == k0

    other_lr = _request(lr=0.07)
    assert memo.key(other_lr, other_lr.variants[0]) != k0
    batch = load_rollout(ROLLOUT)
    rewards = batch.tensors["scores"].clone()
    rewards[0] += 0.5
    changed = dataclasses.replace(batch, tensors={**batch.tensors, "scores": rewards})
    req = _request(batch=changed)
    assert memo.key(req, req.variants[0]) != k0
    noisy = _request(weight_noise=1e-7)
    assert memo.key(noisy, noisy.variants[0]) != k0
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)
        assert memo.key(base, base.variants[0]) != k0
    finally:
        torch.set_num_threads(threads)

    # a snapshot whose weights are rewritten in place is another key, and replays anew
    copy = tmp_path / "model"
    shutil.copytree(MODEL, copy)
    req = _request(model=str(copy))
    before = _replay(req)
    k1 = memo.key(req, req.variants[0])
    from safetensors.torch import load_file, save_file
    (weights,) = copy.glob("*.safetensors")
    state = load_file(weights)
    name = next(n for n in state if n.endswith("lm_head.weight") or "embed" in n)
    state[name] = state[name] * 1.5
    save_file(state, weights, metadata={"format": "pt"})
    assert memo.key(req, req.variants[0]) != k1
    from rlaudit.backends import reference
    reference._cached_model.cache_clear()     # the model cache is keyed by path alone
    after = _replay(req)
    assert after.steps[0]["actor/pg_loss"] != before.steps[0]["actor/pg_loss"]


def test_what_is_never_memoised(monkeypatch):
    req = _request()
    v = req.variants[0]
    assert memo.key(dataclasses.replace(req, device="cuda"), v) is None
    assert memo.key(req, dataclasses.replace(v, probe=object())) is None
    with memo.disabled():
        assert memo.key(req, v) is None
    monkeypatch.setenv("RLAUDIT_REFERENCE_MEMO_MB", "0")
    assert memo.key(req, v) is None


@pytest.mark.parametrize("value", ["lots", "-1", "nan"])
def test_a_bad_memo_size_is_an_input_error_naming_the_variable(monkeypatch, value):
    from rlaudit.errors import InputError
    monkeypatch.setenv("RLAUDIT_REFERENCE_MEMO_MB", value)
    req = _request()
    with pytest.raises(InputError, match="RLAUDIT_REFERENCE_MEMO_MB.*got"):
        ReferenceBackend().replay(req)


def test_least_recently_used_goes_first(monkeypatch):
    a, b, c = _request(lr=0.01), _request(lr=0.02), _request(lr=0.03)
    run = _replay(a)
    one = memo._size(run)
    start = run.params_initial.numel() * run.params_initial.element_size()   # kept once
    monkeypatch.setenv("RLAUDIT_REFERENCE_MEMO_MB", str((2.5 * one + start) / (1 << 20)))  # two
    memo.clear()
    _replay(a), _replay(b)
    _replay(a)                           # a is now the most recent
    _replay(c)                           # b goes
    keys = [memo.key(r, r.variants[0]) for r in (a, b, c)]
    assert [k in memo._entries for k in keys] == [True, False, True]


def test_initial_parameters_are_kept_once_and_handed_out_as_copies(monkeypatch):
    """Runs from the same starting point share one kept copy of their initial parameters; each
    caller gets its own; the copy goes when the last run starting from it is evicted."""
    a, b = _request(lr=0.01), _request(lr=0.02)
    want = _fresh(a).params_initial
    ra, rb = _replay(a), _replay(b)
    (kept,) = memo._initials
    assert all(run.params_initial is kept for run, _ in memo._entries.values())
    assert len(memo._entries) == 2 and torch.equal(kept, want)
    got = _replay(a)                                   # a hit
    assert got.params_initial is not kept and torch.equal(got.params_initial, want)
    got.params_initial.add_(1.0)
    assert torch.equal(kept, want) and torch.equal(_replay(b).params_initial, want)
    assert memo._bytes == sum(size for _, size in memo._entries.values()) + \
        kept.numel() * kept.element_size()
    noisy = _request(lr=0.01, weight_noise=1e-3)       # another starting point
    fresh = _fresh(noisy)
    start = fresh.params_initial
    assert not torch.equal(start, want)
    room = memo._size(fresh) + start.numel() * start.element_size()
    monkeypatch.setenv("RLAUDIT_REFERENCE_MEMO_MB", str(room / (1 << 20)))  # room for one
    _replay(noisy)                                     # a and b go, and their start with them
    (only,) = memo._initials
    assert only is not kept and torch.equal(only, start) and len(memo._entries) == 1
    assert memo._bytes == room
