"""The hypothesis strategies produce valid batches and reach the edge cases they promise."""

from __future__ import annotations

import pytest
import torch
from hypothesis import Phase, find, given, settings

from rlaudit.data.batch import REQUIRED_FIELDS
from rlaudit.errors import InputError
from rlaudit.strategies import (GARBAGE_MAX, SUPPORTED_FIELDS, loss_matrices, permutations,
                                rollout_batches)

# generate only: we want *an* example, not a shrunk one (shrinking costs seconds)
FIND = settings(max_examples=300, database=None, phases=[Phase.generate])
LOG_PROBS = ("rollout_log_probs", "old_log_probs", "ref_log_probs", "teacher_log_probs",
             "teacher_topk_log_probs")


@given(rollout_batches(fields=SUPPORTED_FIELDS))
def test_batches_are_valid_and_well_formed(batch):
    batch.validate()
    assert set(REQUIRED_FIELDS) | set(SUPPORTED_FIELDS) == set(batch.keys())
    b, r = len(batch), batch.response_width
    pl, rl, uid, mask = (batch["prompt_lengths"], batch["response_lengths"], batch["uid"],
                         batch.mask)
    groups = {}
    for i in range(b):
        groups.setdefault(int(uid[i]), []).append(i)
        assert 0 <= int(rl[i]) <= 8 and 1 <= int(pl[i]) <= 6
        for t in range(r):
            assert not (bool(mask[i, t]) and t >= int(rl[i]))
    assert 1 <= len(groups) <= 4 and all(1 <= len(rows) <= 4 for rows in groups.values())
    for rows in groups.values():  # rows of a group share their prompt
        for i in rows:
            assert int(pl[i]) == int(pl[rows[0]])
            assert torch.equal(batch["prompt_ids"][i], batch["prompt_ids"][rows[0]])
    for name in LOG_PROBS:
        keep = mask if batch[name].dim() == 2 else mask.unsqueeze(-1).expand_as(batch[name])
        assert bool((batch[name][keep] <= 0).all()), name
    assert bool((batch["entropy"][mask] >= 0).all())
    assert bool((batch["rollout_is_weights"][mask] >= 0).all())
    for name in ("response_ids", "prompt_ids", "teacher_topk_ids"):
        assert 0 <= int(batch[name].min()) and int(batch[name].max()) < 32
    assert batch["teacher_topk_ids"].shape == (b, r, 3)
    for name in SUPPORTED_FIELDS:
        t = batch[name]
        if t.is_floating_point():
            assert t.dtype == torch.float64 and float(t.abs().max()) <= GARBAGE_MAX


@given(rollout_batches(min_groups=2, max_groups=2, min_group_size=3, max_group_size=3,
                       allow_empty_responses=False, allow_masked_holes=False, max_prompt_len=2,
                       max_response_len=3, dtype=torch.bfloat16, fields=("old_log_probs",)))
def test_bounds_and_switches_are_respected(batch):
    assert len(batch) == 6 and len(set(batch["uid"].tolist())) == 2
    assert batch.prompt_width <= 2 and batch.response_width <= 3
    rl = batch["response_lengths"]
    assert int(rl.min()) >= 1
    want = torch.arange(batch.response_width).unsqueeze(0) < rl.unsqueeze(1)
    assert torch.equal(batch.mask, want)
    assert batch["old_log_probs"].dtype == torch.bfloat16
    assert set(batch.keys()) == set(REQUIRED_FIELDS) | {"old_log_probs"}


def _has_hole(b):
    rl, m = b["response_lengths"], b.mask
    return any(not bool(m[i, t]) and bool(m[i, t + 1:int(rl[i])].any())
               for i in range(len(b)) for t in range(int(rl[i])))


def _non_contiguous_group(b):
    uid = b["uid"].tolist()
    seen_closed = set()
    for i in range(1, len(uid)):
        if uid[i] != uid[i - 1]:
            seen_closed.add(uid[i - 1])
            if uid[i] in seen_closed:
                return True
    return False


def _garbage_under_mask(b):
    lp = b["old_log_probs"]
    return bool((lp.abs()[~b.mask] > 1e3).any())


@pytest.mark.parametrize("name, condition", [
    ("singleton group", lambda b: any(b["uid"].tolist().count(u) == 1 for u in b["uid"].tolist())),
    ("empty response", lambda b: bool((b["response_lengths"] == 0).any())),
    ("all-masked row of positive length",
     lambda b: any(int(b["response_lengths"][i]) > 0 and not bool(b.mask[i].any())
                   for i in range(len(b)))),
    ("masked hole inside a response", _has_hole),
    ("non-contiguous group", _non_contiguous_group),
    ("uid outside int32", lambda b: bool((b["uid"].abs() > 2**31).any())),
    ("large garbage under mask 0", _garbage_under_mask),
    ("extra prompt padding", lambda b: b.prompt_width > int(b["prompt_lengths"].max())),
    ("extra response padding", lambda b: b.response_width > int(b["response_lengths"].max())),
    ("groups with zero score std", lambda b: any(
        len(set(b["scores"][b["uid"] == u].tolist())) == 1 and int((b["uid"] == u).sum()) > 1
        for u in set(b["uid"].tolist()))),
])
def test_edge_cases_are_reached(name, condition):
    find(rollout_batches(), condition, settings=FIND)


@pytest.mark.parametrize("kwargs, key", [
    ({"min_groups": 0}, "min_groups"),
    ({"min_groups": 3, "max_groups": 2}, "min_groups"),
    ({"max_group_size": 0}, "max_group_size"),
    ({"min_group_size": 5}, "min_group_size"),
    ({"max_prompt_len": 0}, "max_prompt_len"),
    ({"max_response_len": 1.5}, "max_response_len"),
    ({"dtype": torch.int64}, "dtype"),
    ({"fields": ("kl_divergence",)}, "fields"),
    ({"fields": "scores"}, "fields"),
    ({"vocab_size": True}, "vocab_size"),
])
def test_bad_arguments_are_named_eagerly(kwargs, key):
    with pytest.raises(InputError) as err:
        rollout_batches(**kwargs)  # no draw needed: validated when called
    assert err.value.key == key and key in str(err.value)


@given(loss_matrices(min_rows=2, max_rows=4, max_width=5, allow_empty_rows=False))
def test_loss_matrices(pair):
    loss, mask = pair
    assert loss.shape == mask.shape and mask.dtype == torch.bool and loss.dtype == torch.float64
    assert 2 <= loss.shape[0] <= 4 and 1 <= loss.shape[1] <= 5
    assert bool(mask.any(1).all())
    assert bool(torch.isfinite(loss).all()) and float(loss[mask].abs().max()) <= 100.0


def test_loss_matrices_reach_empty_rows_and_garbage():
    find(loss_matrices(), lambda p: bool((~p[1].any(1)).any()), settings=FIND)
    find(loss_matrices(), lambda p: bool((p[0].abs()[~p[1]] > 1e6).any()), settings=FIND)
    with pytest.raises(InputError) as err:
        loss_matrices(max_abs=0.0)
    assert err.value.key == "max_abs"
    with pytest.raises(InputError) as err:
        loss_matrices(min_width=4, max_width=3)
    assert err.value.key == "min_width"


@given(permutations(6))
def test_permutations(p):
    assert p.dtype == torch.int64 and sorted(p.tolist()) == list(range(6))


def test_permutations_arguments():
    assert find(permutations(0), lambda p: True).tolist() == []
    find(permutations(5), lambda p: p.tolist() != list(range(5)), settings=FIND)
    with pytest.raises(InputError) as err:
        permutations(-1)
    assert err.value.key == "n"
