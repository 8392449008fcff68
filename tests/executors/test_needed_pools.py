"""executors.needed_pools: the warm pools an invocation's multi-rank replays will use, in order of
first use, one entry per (pool, world size, device, threads) -- what the local executor starts
in the background before the first replay asks for it."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlaudit.executors import needed_pools
from rlaudit.scenarios.spec import load_scenario

SCENARIOS = Path(__file__).resolve().parents[2] / "scenarios"


def _load(*names):
    return [load_scenario(SCENARIOS / f"{n}.yaml") for n in names]


def test_pools_of_the_multi_rank_backends_in_order_of_first_use():
    pytest.importorskip("megatron.core")
    # kl_k1: fsdp dp=2, megatron tp=2; agg_token_mean: megatron pp=2 (the same world size, so
    # the same pool); seed_padding_microbatches: fsdp dp=2 again, megatron tp=2 x dp=2 (four)
    got = needed_pools(_load("kl_k1", "agg_token_mean", "seed_padding_microbatches"), None)
    assert got == [("fsdp", 2, "cpu", 1), ("megatron", 2, "cpu", 1), ("megatron", 4, "cpu", 1)]


def test_reference_only_and_backend_filters_need_no_pool_they_do_not_use():
    assert needed_pools(_load("rollout_is_stale_mask"), None) == []
    assert needed_pools(_load("kl_k1"), ["reference"]) == []
    assert needed_pools(_load("kl_k1"), ["reference", "fsdp"]) == [("fsdp", 2, "cpu", 1)]
