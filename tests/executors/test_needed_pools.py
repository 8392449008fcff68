"""executors.needed_pools: the warm pools an invocation's replays will use, in order of first use,
one entry per (pool, world size, device, threads) -- what the local executor starts in the
background before the first replay asks for it: the multi-rank backends', and the reference's
one-rank pool where it replays beside them on the CPU (executors.reference_pooled)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from rlaudit.executors import needed_pools, reference_pooled
from rlaudit.scenarios.spec import load_scenario

SCENARIOS = Path(__file__).resolve().parents[2] / "scenarios"


class Request(str):
    """A replay request as the stub backends here see it: a name, and the time it may take
    (what the engine gives each replay: what is left of its scenario's --timeout)."""

    timeout = 60.0


def _load(*names):
    return [load_scenario(SCENARIOS / f"{n}.yaml") for n in names]


def test_pools_of_the_multi_rank_backends_in_order_of_first_use():
    pytest.importorskip("megatron.core")
    # kl_k1: fsdp dp=2, megatron tp=2; agg_token_mean: megatron pp=2 (the same world size, so
    # the same pool); seed_padding_microbatches: fsdp dp=2 again, megatron tp=2 x dp=2 (four)
    got = needed_pools(_load("kl_k1", "agg_token_mean", "seed_padding_microbatches"), None)
    assert got == [("reference", 1, "cpu", 1), ("fsdp", 2, "cpu", 1), ("megatron", 2, "cpu", 1),
                   ("megatron", 4, "cpu", 1)]


def test_reference_only_and_backend_filters_need_no_pool_they_do_not_use():
    assert needed_pools(_load("rollout_is_stale_mask"), None) == []
    assert needed_pools(_load("kl_k1"), ["reference"]) == []
    assert needed_pools(_load("kl_k1"), ["reference", "fsdp"]) == [("reference", 1, "cpu", 1),
                                                                    ("fsdp", 2, "cpu", 1)]
    assert needed_pools(_load("kl_k1"), ["fsdp"]) == [("fsdp", 2, "cpu", 1)]


def test_the_reference_goes_to_a_pool_only_beside_a_multi_rank_backend_on_the_cpu(monkeypatch):
    kl_k1, stale_mask = _load("kl_k1", "rollout_is_stale_mask")
    assert reference_pooled(kl_k1, None) and reference_pooled(kl_k1, ["reference", "fsdp"])
    assert not reference_pooled(kl_k1, ["reference"])       # nothing forks ranks
    assert not reference_pooled(kl_k1, ["fsdp"])            # no reference replay at all
    assert not reference_pooled(stale_mask, None)           # a reference-only scenario
    on_gpu = dataclasses.replace(kl_k1, device="cuda")
    assert not reference_pooled(on_gpu, None)               # the GPU: as before, in-process
    monkeypatch.setenv("RLAUDIT_THREADS", "2")              # the in-process thread count
    assert needed_pools([kl_k1], ["reference", "fsdp"])[0] == ("reference", 1, "cpu", 2)


def test_the_local_executor_sends_those_reference_replays_to_the_pool(monkeypatch):
    """Inside a warm_pools block the reference of a scenario beside a multi-rank backend goes to
    ``replay_in_pool``, a reference-only scenario's replays here; outside a block, every
    reference replays here. ``when_idle`` comes after the first in-process replay -- or, when no
    reference replays in-process, as the first pooled one starts."""
    from rlaudit.backends.launch import pool as pool_mod
    from rlaudit.backends.launch.pool import PoolSet, warm_pools
    from rlaudit.executors import LocalExecutor, Progress

    prestarted = []
    monkeypatch.setattr(PoolSet, "prestart", lambda self, keys, timeout=300.0:
                        prestarted.extend(keys))  # no ranks for a stub backend
    kl_k1, stale_mask = _load("kl_k1", "rollout_is_stale_mask")
    calls, idle = [], []

    class Reference:
        name = "reference"

        def replay(self, request):
            calls.append(("here", request, len(idle)))
            return {"base": request}

        def replay_in_pool(self, request, *, threads):
            calls.append(("pool", request, len(idle), threads))
            return {"base": request}

    def run_all(scenarios=(kl_k1, stale_mask)):
        with LocalExecutor(Progress(2, enabled=False), jobs=1, scenarios=scenarios,
                           when_idle=lambda: idle.append(1)) as ex:
            return [res for _, res in ex.map(scenarios,
                                             lambda scn, replay: replay(Reference(), Request(scn.name)))]

    with warm_pools():
        assert run_all() == [{"base": "kl_k1"}, {"base": "rollout_is_stale_mask"}]
        assert calls == [("pool", "kl_k1", 0, 1), ("here", "rollout_is_stale_mask", 0)]
        assert idle == [1] and prestarted[0] == ("reference", 1, "cpu", 1)
        calls.clear()
        idle.clear()
        run_all((kl_k1,))  # nothing replays here: idle from the first pooled replay
        assert calls == [("pool", "kl_k1", 1, 1)] and idle == [1]
    calls.clear()
    idle.clear()
    monkeypatch.setattr(pool_mod, "_ACTIVE", [])  # no warm_pools block (not even the session's)
    run_all()
    assert calls == [("here", "kl_k1", 0), ("here", "rollout_is_stale_mask", 1)] and idle == [1]
