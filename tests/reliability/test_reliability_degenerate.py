"""Degenerate data is an input error naming what is empty, never a vacuous pass (issue #13 cases
1 and 2, and the cuts and variants that leave an invariant nothing to compare)."""

from __future__ import annotations

import pytest
import torch
from reltools import (ROLLOUT, assert_named, base_tensors, scenario_dict, write_rollout,
                      write_scenario)

from rlaudit.data.batch import RolloutBatch
from rlaudit.data.io import load_rollout, save_rollout
from rlaudit.errors import InputError


def _run(cli, tmp, scn, *extra):
    res = cli("run", scn, "--golden-dir", tmp / "golden", "--report-dir", tmp / "reports",
              "--no-mlflow", *extra)
    assert res.rc == 2, res.err
    assert "running" not in res.err and "Traceback" not in res.err
    assert not (tmp / "reports").exists() and not (tmp / "golden").exists()
    return res


def test_case1_zero_row_rollout_exits_2_and_cannot_be_saved(cli, tmp_path):
    """Case 1: a 0-row rollout crashed inside the metamorphic invariants with exit 1."""
    empty = {k: v[:0].clone() for k, v in base_tensors().items()}
    r = write_rollout(tmp_path / "rollouts" / "empty.safetensors", empty)
    scn = write_scenario(tmp_path / "empty.yaml", rollout=str(r),
                         invariants=["sanity-bounds", "row-permutation", "masked-values"])
    res = _run(cli, tmp_path, scn)
    assert_named(res.err, r, "response_ids")
    assert "0 rows" in res.err
    # and save_rollout refuses to write one in the first place
    batch = RolloutBatch.from_tensors(empty, kinds=load_rollout(ROLLOUT).kinds)
    out = tmp_path / "new" / "empty.safetensors"
    out.parent.mkdir()
    with pytest.raises(InputError) as e:
        save_rollout(batch, out)
    assert e.value.key == "response_ids" and "0 rows" in str(e.value)
    assert list(out.parent.iterdir()) == []


def test_case2_all_false_response_mask_exits_2(cli, tmp_path):
    """Case 2: a rollout whose response_mask is all False passed with exit 0 (loss 0, grad norm
    0, every invariant vacuously true)."""
    t = base_tensors()
    t["response_mask"] = torch.zeros_like(t["response_mask"])
    r = write_rollout(tmp_path / "rollouts" / "masked.safetensors", t)
    scn = write_scenario(tmp_path / "masked.yaml", rollout=str(r))
    res = _run(cli, tmp_path, scn)
    assert_named(res.err, r, "response_mask")
    assert "no token to train on" in res.err


def test_a_mini_batch_without_a_trainable_token_exits_2(cli, tmp_path):
    """Rows 0-3 (the first prompt's group, one mini-batch of 1 prompt x n=4) have no token with
    response_mask True: that optimizer step trains on nothing."""
    t = base_tensors()
    t["response_mask"][:4] = False
    r = write_rollout(tmp_path / "rollouts" / "hole.safetensors", t)
    d = scenario_dict(rollout=str(r))
    d["config"]["actor"]["ppo_mini_batch_size"] = 1
    scn = write_scenario(tmp_path / "hole.yaml", d)
    res = _run(cli, tmp_path, scn)
    assert_named(res.err, scn, "config.actor.ppo_mini_batch_size")
    assert "mini-batch 0 of epoch 0 (rows [0, 1, 2, 3]) has no token" in res.err


@pytest.mark.parametrize("invariant,index", [("microbatch-invariance", 2),
                                             ("batch-invariance", 3)])
def test_an_invariant_left_nothing_to_compare_exits_2_naming_it(cli, tmp_path, invariant, index):
    """One-row mini-batches: cutting a mini-batch into other micro-batches changes nothing, so
    these invariants would pass vacuously. (row-permutation does not: rows shuffled within a
    mini-batch change nothing, but it also shuffles them across the mini-batches.)"""
    d = scenario_dict(invariants=["sanity-bounds", "row-permutation", "microbatch-invariance",
                                  "batch-invariance"])
    d["config"]["rollout"]["n"] = 1
    d["config"]["actor"].update(ppo_mini_batch_size=1, ppo_micro_batch_size_per_gpu=1)
    scn = write_scenario(tmp_path / "one_row.yaml", d)
    res = _run(cli, tmp_path, scn)
    assert "2 input problems" in res.err and "row-permutation" not in res.err
    assert_named(res.err, scn, f"invariants[{index}]")
    assert f"invariants[{index}]: {invariant} has nothing to compare" in res.err
    assert "each mini-batch has one row" in res.err


def test_masked_values_with_nothing_under_the_mask_exits_2(cli, tmp_path):
    """Every prompt and response at full width, nothing masked: the garbage-under-the-mask run
    is the baseline itself."""
    t = base_tensors()
    b, p = t["prompt_ids"].shape
    r_width = t["response_ids"].shape[1]
    t["prompt_lengths"] = torch.full((b,), p, dtype=t["prompt_lengths"].dtype)
    t["response_lengths"] = torch.full((b,), r_width, dtype=t["response_lengths"].dtype)
    t["response_mask"] = torch.ones_like(t["response_mask"])
    r = write_rollout(tmp_path / "rollouts" / "full.safetensors", t)
    scn = write_scenario(tmp_path / "full.yaml", rollout=str(r),
                         invariants=["sanity-bounds", "masked-values"])
    res = _run(cli, tmp_path, scn)
    assert_named(res.err, scn, "invariants[1]")
    assert "masked-values has nothing to compare" in res.err


def test_a_dapo_filter_that_keeps_no_group_exits_2(cli, tmp_path):
    t = base_tensors()
    t["scores"] = torch.ones_like(t["scores"])  # every group uniform: DAPO drops them all
    r = write_rollout(tmp_path / "rollouts" / "uniform.safetensors", t)
    d = scenario_dict(rollout=str(r))
    d["config"]["algorithm"] = {"filter_groups": {"enable": True, "metric": "acc"}}
    scn = write_scenario(tmp_path / "dapo.yaml", d)
    res = _run(cli, tmp_path, scn)
    assert_named(res.err, scn, "config.algorithm.filter_groups.enable")
    assert "keeps no group" in res.err


@pytest.mark.parametrize("edit,key,fragment", [
    (lambda d: d["backends"].update(fsdp={"dp": 3}), "backends.fsdp.dp",
     "dp=3 does not divide the 8 rows of a mini-batch"),
    (lambda d: d["config"]["actor"].update(ppo_mini_batch_size=3),
     "config.actor.ppo_mini_batch_size", "12 rows per mini-batch do not divide the 16 rows"),
    (lambda d: d["config"]["actor"].update(use_dynamic_bsz=True, ppo_max_token_len_per_gpu=8),
     "config.actor.ppo_max_token_len_per_gpu", "more than the micro-batch token budget 8"),
], ids=["dp", "mini-batch", "token-budget"])
def test_a_cut_the_backends_cannot_make_exits_2_up_front(cli, tmp_path, edit, key, fragment):
    """Found before anything runs, not inside a rank after the reference backend's replay."""
    d = scenario_dict()
    edit(d)
    scn = write_scenario(tmp_path / "cut.yaml", d)
    res = _run(cli, tmp_path, scn, "--backend", "reference")
    assert_named(res.err, scn, key)
    assert fragment in res.err
