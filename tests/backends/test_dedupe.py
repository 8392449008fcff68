"""Each distinct variant replayed once per backend (rlaudit/backends/dedupe.py): twins are found by
what a replay depends on and by nothing else, every name still gets a run, and that run is bit
for bit what a replay of its own would give -- on the FSDP backend's ranks and through the
scenario engine, whose checks come out the same as when every name is replayed."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from rlaudit.backends import dedupe, memo
from rlaudit.backends.base import ReplayRequest, Variant
from rlaudit.backends.reference import ReferenceBackend
from rlaudit.config import load_config
from rlaudit.data.batch import Kind, RolloutBatch
from rlaudit.data.io import load_rollout
from rlaudit.scenarios.invariants.base import with_overrides
from test_memo import _same  # bit for bit, timings aside

ROOT = os.path.join(os.path.dirname(__file__), "..", "..", "scenarios")
MODEL = os.path.abspath(os.path.join(ROOT, "models", "qwen2-tiny-short"))
ROLLOUT = os.path.abspath(os.path.join(ROOT, "rollouts", "short-ref.safetensors"))


def _cfg_dict(**actor):
    return {"rollout": {"n": 4, "response_length": 12},
            "actor": {"ppo_mini_batch_size": 2, "ppo_micro_batch_size_per_gpu": 2,
                      "calculate_entropy": True, "optim": {"name": "sgd", "lr": 0.05}, **actor},
            "trainer": {"dtype": "float64"}}


def _cfg(**actor):
    return load_config(_cfg_dict(**actor))


@pytest.fixture(scope="module")
def batch():
    return load_rollout(ROLLOUT)


def _names(variants):
    return [v.name for v in variants]


# ---- what counts as a twin -------------------------------------------------------------------

def test_same_inputs_under_another_name_are_one_replay(batch):
    a = Variant("base", _cfg(), batch, steps=2)
    b = Variant("base:short", _cfg(), batch.with_fields(), steps=2)  # equal, not the same object
    c = Variant("other", _cfg(), batch, steps=1)
    keep, aliases = dedupe.distinct([a, b, c], backend="fsdp")
    assert _names(keep) == ["base", "other"]
    assert aliases == {"base:short": "base"}


@pytest.mark.parametrize("change", ["config", "steps", "batch", "kinds", "meta"])
def test_anything_a_replay_reads_makes_another_replay(batch, change):
    a = Variant("a", _cfg(), batch, steps=1)
    b = Variant("b", _cfg(), batch, steps=1)
    if change == "config":
        b.config = with_overrides(b.config, **{"actor.clip_ratio_high": 0.3})
    elif change == "steps":
        b.steps = 2
    elif change == "batch":
        lp = batch["rollout_log_probs"].clone()
        lp[0, 0] = torch.nextafter(lp[0, 0], torch.tensor(0.0, dtype=lp.dtype))  # one ulp
        b.batch = batch.with_fields(rollout_log_probs=lp)
    elif change == "kinds":
        b.batch = RolloutBatch(dict(batch.tensors), {**batch.kinds, "scores": Kind.PROMPT},
                               dict(batch.meta))
    else:
        b.batch = dataclasses.replace(batch, meta={**batch.meta, "engine": "another"})
    keep, aliases = dedupe.distinct([a, b], backend="fsdp")
    assert _names(keep) == ["a", "b"] and aliases == {}


def test_probe_reruns_are_always_replayed(batch):
    a = Variant("a", _cfg(), batch, steps=1)
    b = Variant("b", _cfg(), batch, steps=1, probe=object())
    keep, aliases = dedupe.distinct([a, b], backend="fsdp")
    assert _names(keep) == ["a", "b"] and aliases == {}


def test_a_fault_aimed_at_one_name_splits_its_twins(batch):
    a, b = Variant("base", _cfg(), batch, steps=1), Variant("base:short", _cfg(), batch, steps=1)
    keep, aliases = dedupe.distinct([a, b], backend="fsdp",
                                    fault_spec="fsdp/base:lr_scale:factor=1.5")
    assert _names(keep) == ["base", "base:short"] and aliases == {}
    # a fault on every variant, or on another backend, applies to both alike
    for spec in ("fsdp:lr_scale:factor=1.5", "megatron/base:lr_scale:factor=1.5"):
        keep, aliases = dedupe.distinct([a, b], backend="fsdp", fault_spec=spec)
        assert aliases == {"base:short": "base"}, spec


# ---- the runs handed back --------------------------------------------------------------------

class _Counting:
    def __init__(self):
        self.sent = []

    def __call__(self, backend, request):
        self.sent.append(_names(request.variants))
        return backend.replay(request)


def test_every_name_gets_its_own_copy(batch):
    variants = [Variant("base", _cfg(), batch, steps=1), Variant("other", _cfg(), batch, steps=1),
                Variant("base:short", _cfg(), batch, steps=1)]
    request = ReplayRequest(model=MODEL, variants=variants, dtype="float64")
    replay = _Counting()
    with memo.disabled():
        runs = dedupe.replay_distinct(replay, ReferenceBackend(), request)
    assert replay.sent == [["base"]]  # "other" and "base:short" are twins of "base"
    assert list(runs) == ["base", "other", "base:short"]
    assert [r.name for r in runs.values()] == ["base", "other", "base:short"]
    assert _same(runs["other"], runs["base"]) and runs["other"] is not runs["base"]
    runs["other"].tokens["old_log_probs"].add_(1.0)   # a check that writes to its run
    runs["other"].steps[0]["actor/pg_loss"] = 123.0
    assert _same(runs["base:short"], runs["base"])
    assert not _same(runs["other"], runs["base"])


@pytest.mark.slow
def test_twins_on_fsdp_ranks_equal_their_own_replays(batch):
    """The multi-rank backends are where a repeat costs: an alias's run equals the run the same
    ranks give when that name is replayed on its own."""
    from rlaudit.backends.fsdp import FSDPBackend

    variants = [Variant("base", _cfg(), batch, steps=2),
                Variant("cfg", _cfg(loss_agg_mode="seq-mean-token-sum"), batch, steps=1),
                Variant("base:short", _cfg(), batch, steps=2)]
    request = ReplayRequest(model=MODEL, variants=variants, layout={"dp": 2}, dtype="float64",
                            timeout=600)
    replay = _Counting()
    runs = dedupe.replay_distinct(replay, FSDPBackend(), request)
    assert replay.sent == [["base", "cfg"]]
    alone = FSDPBackend().replay(dataclasses.replace(request, variants=variants[2:]))
    assert _same(runs["base:short"], alone["base:short"])
    assert runs["base:short"].info["layout"] == {"dp": 2}


def test_scenario_checks_are_those_of_replaying_every_name(monkeypatch):
    """Through the engine (reference backend, memo off): the same checks, statuses, messages and
    drifts as when each variant name is replayed; fewer replays."""
    from rlaudit.scenarios import engine
    from rlaudit.scenarios.spec import load_scenario

    scn = load_scenario(os.path.join(ROOT, "adv_rloo.yaml"))
    counted = _Counting()
    monkeypatch.setenv("RLAUDIT_REFERENCE_MEMO_MB", "0")
    deduped = engine.run_scenario(scn, backends=["reference"], replay=counted)
    monkeypatch.setattr(engine, "replay_distinct", lambda replay, b, r: replay(b, r))
    every = _Counting()
    full = engine.run_scenario(scn, backends=["reference"], replay=every)
    assert len(counted.sent[0]) < len(every.sent[0])
    assert set(deduped.runs["reference"]) == set(every.sent[0])

    def lines(res):
        return [(c.invariant, c.backend, c.status, c.message, c.drift) for c in res.checks]

    assert lines(deduped) == lines(full)
    for name, run in full.runs["reference"].items():
        assert _same(deduped.runs["reference"][name], run), name


def test_the_critic_section_counts_only_with_a_critic(batch):
    """No backend reads ``critic.*`` unless adv_estimator is gae: without a critic, two variants
    that differ there only are one replay -- and replayed apart (memo off) they are bit for bit
    the same; with a critic they are two."""
    def pair(**algo):
        a = Variant("base", load_config({**_cfg_dict(), "algorithm": algo}), batch, steps=1)
        b = Variant("microbatch:1", with_overrides(a.config, **{
            "critic.ppo_micro_batch_size_per_gpu": 1, "critic.optim.lr": 0.5}), batch, steps=1)
        return a, b

    a, b = pair(adv_estimator="grpo")
    keep, aliases = dedupe.distinct([a, b], backend="megatron")
    assert _names(keep) == ["base"] and aliases == {"microbatch:1": "base"}
    request = ReplayRequest(model=MODEL, variants=[a, b], dtype="float64")
    with memo.disabled():
        runs = ReferenceBackend().replay(request)   # both replayed (no dedupe here)
    assert _same(runs["base"], runs["microbatch:1"])

    keep, aliases = dedupe.distinct(list(pair(adv_estimator="gae")), backend="megatron")
    assert _names(keep) == ["base", "microbatch:1"] and aliases == {}

    # the scenario validator's "an invariant has nothing to compare" judges by the same rule
    from types import SimpleNamespace

    from rlaudit.scenarios import variants

    def signature(v):
        cut, issues = variants._cut(SimpleNamespace(backends={}), v)
        assert not issues
        return variants._signature(v, cut)

    a, b = pair(adv_estimator="grpo")
    assert signature(a) == signature(b)
    a, b = pair(adv_estimator="gae")
    assert signature(a) != signature(b)
