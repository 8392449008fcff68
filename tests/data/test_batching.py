"""Mini/micro batching, data-parallel shards and padding micro-batches."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from rlaudit.data.batch import Kind, RolloutBatch
from rlaudit.data.batching import (PADDING_UID, is_padding_microbatch, microbatches_by_count,
                                   microbatches_by_tokens, pad_microbatch_list, padding_microbatch,
                                   plan_dp_shards, plan_microbatches_by_count,
                                   plan_microbatches_by_tokens, plan_minibatches, shard_for_dp,
                                   split_minibatches, take)
from rlaudit.errors import InputError
from rlaudit.strategies import SUPPORTED_FIELDS, rollout_batches


def make_batch(prompt_lens, resp_lens, r=None, p=None) -> RolloutBatch:
    """Rows with given lengths; every field's values encode the row index (to check selection)."""
    b = len(prompt_lens)
    r = r or max(1, *resp_lens)
    p = p or max(prompt_lens)
    rows = torch.arange(b)
    mask = torch.arange(r).unsqueeze(0) < torch.tensor(resp_lens).unsqueeze(1)
    return RolloutBatch.from_tensors({
        "prompt_ids": rows.unsqueeze(1).repeat(1, p),
        "prompt_lengths": torch.tensor(prompt_lens),
        "response_ids": rows.unsqueeze(1).repeat(1, r) + 100,
        "response_lengths": torch.tensor(resp_lens),
        "response_mask": mask,
        "uid": rows // 2,
        "old_log_probs": -rows.to(torch.float64).unsqueeze(1).repeat(1, r),
    })


def covered_once(plan, b):
    rows = sorted(int(i) for piece in plan for i in piece)
    return rows == list(range(b))


def assert_rows(piece: RolloutBatch, parent: RolloutBatch, rows):
    """piece's j-th row equals parent's rows[j] in every field (naive loop)."""
    assert len(piece) == len(rows) and set(piece.keys()) == set(parent.keys())
    for name in parent.keys():
        assert piece[name].shape[1:] == parent[name].shape[1:]
        for j, i in enumerate(rows):
            assert torch.equal(piece[name][j], parent[name][int(i)]), (name, j, i)


# ---- mini-batches ---------------------------------------------------------------------------
def test_minibatches_in_order_and_shuffled():
    assert [p.tolist() for p in plan_minibatches(6, 2)] == [[0, 1], [2, 3], [4, 5]]
    a = plan_minibatches(12, 4, shuffle=True, seed=3)
    assert covered_once(a, 12) and all(len(p) == 4 for p in a)
    assert [p.tolist() for p in a] == [p.tolist() for p in plan_minibatches(12, 4, shuffle=True,
                                                                              seed=3)]
    assert any(not torch.equal(torch.cat(plan_minibatches(12, 4, shuffle=True, seed=s)),
                               torch.arange(12)) for s in range(3))
    batch = make_batch([1, 2, 3, 1], [2, 0, 3, 1])
    minis = split_minibatches(batch, 2, shuffle=True, seed=5)
    for piece, rows in zip(minis, plan_minibatches(4, 2, shuffle=True, seed=5)):
        assert_rows(piece, batch, rows)


@pytest.mark.parametrize("size", [4, 0, -1, 2.0, True])
def test_minibatch_size_must_divide(size):
    with pytest.raises(InputError) as err:
        plan_minibatches(6, size)
    assert err.value.key == "size"


# ---- data-parallel shards -------------------------------------------------------------------
def test_dp_shards_contiguous():
    batch = make_batch([1] * 6, [1, 2, 3, 0, 1, 2])
    shards = shard_for_dp(batch, 3)
    for k, shard in enumerate(shards):
        assert_rows(shard, batch, [2 * k, 2 * k + 1])
    with pytest.raises(InputError) as err:
        shard_for_dp(batch, 4)
    assert err.value.key == "dp_size" and "6" in str(err.value)


def test_dp_balance_hand_worked():
    # sorted rounds: round 1 deals rows 0, 1 to ranks 0, 1; round 2 gives the lighter rank the
    # larger remaining row
    assert [p.tolist() for p in plan_dp_shards([5, 5, 1, 1], 2, balance=True)] == [[0, 2], [1, 3]]
    assert [p.tolist() for p in plan_dp_shards([1, 1, 5, 5], 2)] == [[0, 1], [2, 3]]
    assert [p.tolist() for p in plan_dp_shards([10, 1, 1, 1], 2, balance=True)] == [[0, 3], [1, 2]]
    # 6 rows, 3 ranks: round 1 gives rows 0, 2, 4 (8, 7, 6) to ranks 0, 1, 2; round 2 gives
    # rows 5, 3, 1 (3, 2, 1) to ranks 2, 1, 0: sums 9 / 9 / 9
    shards = plan_dp_shards([8, 1, 7, 2, 6, 3], 3, balance=True)
    assert [p.tolist() for p in shards] == [[0, 1], [2, 3], [4, 5]]


@given(st.lists(st.integers(1, 40), min_size=1, max_size=24), st.integers(1, 6))
def test_dp_balance_quality(lengths, dp_size):
    lengths = lengths[: len(lengths) - len(lengths) % dp_size] or [1] * dp_size
    shards = plan_dp_shards(torch.tensor(lengths), dp_size, balance=True)
    assert covered_once(shards, len(lengths))
    assert {len(s) for s in shards} == {len(lengths) // dp_size}
    sums = [sum(lengths[i] for i in s.tolist()) for s in shards]
    # naive bound: the spread never exceeds the spread of single rows
    assert max(sums) - min(sums) <= max(lengths) - min(lengths)
    assert all(s.tolist() == sorted(s.tolist()) for s in shards)
    assert [s.tolist() for s in plan_dp_shards(lengths, dp_size, balance=True)] == \
        [s.tolist() for s in shards]  # deterministic


def test_shard_for_dp_balances_sequence_lengths():
    # sequence lengths = prompt + response: 9, 2, 2, 9
    batch = make_batch([4, 1, 1, 5], [5, 1, 1, 4])
    shards = shard_for_dp(batch, 2, balance=True)
    assert [int(s.sequence_lengths().sum()) for s in shards] == [11, 11]
    assert_rows(shards[0], batch, [0, 1])
    assert_rows(shards[1], batch, [2, 3])


# ---- micro-batches --------------------------------------------------------------------------
def test_microbatches_by_count():
    assert [p.tolist() for p in plan_microbatches_by_count(5, 2)] == [[0, 1], [2, 3], [4]]
    assert plan_microbatches_by_count(0, 3) == []
    batch = make_batch([1, 2, 1], [1, 0, 2])
    micros = microbatches_by_count(batch, 2)
    assert_rows(micros[0], batch, [0, 1])
    assert_rows(micros[1], batch, [2])
    assert all(m.response_width == batch.response_width for m in micros)  # no trimming


def test_microbatches_by_tokens_hand_worked():
    lengths = [3, 7, 5, 2, 4]
    assert [p.tolist() for p in plan_microbatches_by_tokens(lengths, 10)] == [[0, 1], [2, 3], [4]]
    ffd = plan_microbatches_by_tokens(lengths, 10, method="first_fit_decreasing")
    assert [p.tolist() for p in ffd] == [[0, 1], [2, 4], [3]]
    # prompt + response: 3, 7, 5, 2, 4
    batch = make_batch([1, 3, 2, 1, 2], [2, 4, 3, 1, 2], r=6)
    micros = microbatches_by_tokens(batch, 10)
    for m, rows in zip(micros, [[0, 1], [2, 3], [4]]):
        assert_rows(m, batch, rows)
        assert m.response_width == 6 and m.prompt_width == 3


def test_row_over_token_budget_is_named():
    with pytest.raises(InputError) as err:
        plan_microbatches_by_tokens([3, 12, 4], 10)
    assert err.value.key == "max_tokens" and "row 1" in str(err.value) and "10" in str(err.value)
    with pytest.raises(InputError):
        plan_microbatches_by_tokens([3], 10, method="best_fit")
    with pytest.raises(InputError):
        plan_microbatches_by_tokens([3.0], 10)


@given(st.lists(st.integers(1, 30), max_size=20), st.integers(30, 80),
       st.sampled_from(["in_order", "first_fit_decreasing"]))
def test_token_budget_properties(lengths, budget, method):
    plan = plan_microbatches_by_tokens(torch.tensor(lengths, dtype=torch.int64), budget,
                                       method=method)
    assert covered_once(plan, len(lengths))
    sums = [sum(lengths[i] for i in p.tolist()) for p in plan]
    assert all(0 < s <= budget for s in sums)
    total = sum(lengths)
    # any two pieces together exceed the budget for first-fit; consecutive ones for in-order
    assert len(plan) < 2 * total / budget + 1 or not lengths
    if method == "in_order":
        flat = [i for p in plan for i in p.tolist()]
        assert flat == list(range(len(lengths)))
        for k in range(len(plan) - 1):
            assert sums[k] + lengths[int(plan[k + 1][0])] > budget  # greedy closes only when full


@given(rollout_batches(max_groups=3, fields=("old_log_probs", "scores")), st.integers(1, 5),
       st.integers(14, 30))
def test_cutters_select_rows_and_do_not_mutate(batch, size, budget):
    before = batch.clone()
    versions = {k: v._version for k, v in batch.tensors.items()}
    ptrs = {v.untyped_storage().data_ptr() for v in batch.tensors.values()}
    cuts = [(microbatches_by_count(batch, size), plan_microbatches_by_count(len(batch), size)),
            (microbatches_by_tokens(batch, budget),
             plan_microbatches_by_tokens(batch.sequence_lengths(), budget))]
    for pieces, plan in cuts:
        assert covered_once(plan, len(batch)) and len(pieces) == len(plan)
        for piece, rows in zip(pieces, plan):
            assert_rows(piece, batch, rows)
            assert not ptrs & {v.untyped_storage().data_ptr() for v in piece.tensors.values()}
    assert all(int(m.sequence_lengths().sum()) <= budget for m in cuts[1][0])
    for k in batch.keys():
        assert batch[k]._version == versions[k] and torch.equal(batch[k], before[k])


# ---- padding micro-batches ------------------------------------------------------------------
def with_extra_fields(batch: RolloutBatch) -> RolloutBatch:
    b, p, r = len(batch), batch.prompt_width, batch.response_width
    return batch.with_fields(
        kinds={"router_topk": "token", "prompt_flags": "prompt", "attempt": "seq",
               "seq_vec": "seq"},
        router_topk=torch.ones(b, r, 2, dtype=torch.int32),
        prompt_flags=torch.ones(b, p, dtype=torch.bool),
        attempt=torch.ones(b, dtype=torch.int16),
        seq_vec=torch.ones(b, 3, dtype=torch.float32),
    )


@given(rollout_batches(max_groups=2, fields=SUPPORTED_FIELDS, dtype=torch.float32))
def test_padding_microbatch_carries_every_field(template):
    template = with_extra_fields(template)
    pad = padding_microbatch(template)
    assert set(pad.keys()) == set(template.keys())
    for name, t in template.tensors.items():
        assert pad.kinds[name] == template.kinds[name], name
        assert pad[name].dtype == t.dtype and pad[name].shape == (1, *t.shape[1:]), name
    assert pad.prompt_width == template.prompt_width
    assert pad.response_width == template.response_width
    assert not pad.mask.any() and pad.num_tokens() == 0
    assert pad["prompt_lengths"].tolist() == [1] and pad["response_lengths"].tolist() == [0]
    assert pad["uid"].tolist() == [PADDING_UID]
    assert is_padding_microbatch(pad) and not is_padding_microbatch(template)
    pad.validate()
    # it concatenates with real micro-batches (same fields, same widths)
    assert len(RolloutBatch.concat([template, pad])) == len(template) + 1


def test_padding_microbatch_from_rollout_log_probs_template():
    """SkyRL #1811: optional per-token fields must be on padding micro-batches too."""
    batch = make_batch([1, 2], [2, 1]).with_fields(
        rollout_log_probs=torch.full((2, 2), -1.0, dtype=torch.bfloat16))
    pad = padding_microbatch(batch)
    assert pad["rollout_log_probs"].dtype == torch.bfloat16
    assert pad["rollout_log_probs"].shape == (1, 2)


def test_padding_contributes_nothing_to_masked_loss_or_grad():
    batch = make_batch([1, 2, 2], [3, 0, 2], r=4).with_fields(
        advantages=torch.tensor([[1.0, -2.0, 0.5, 9.0], [3.0, 3.0, 3.0, 3.0],
                                 [-1.0, 4.0, 7.0, 7.0]], dtype=torch.float64))
    micros = pad_microbatch_list(microbatches_by_count(batch, 2), 4, batch)
    assert [len(m) for m in micros] == [2, 1, 1, 1]
    assert [is_padding_microbatch(m) for m in micros] == [False, False, True, True]
    logits = torch.linspace(-1, 1, 7 * 4, dtype=torch.float64).reshape(7, 4).requires_grad_()

    def loss_of(mb, logp):  # a masked token-sum PG-style loss, written with where()
        ratio = torch.exp(logp - mb["old_log_probs"])
        return torch.where(mb.mask, -mb["advantages"] * ratio, 0.0).sum()

    total, start = 0.0, 0
    for mb in micros:
        total = total + loss_of(mb, logits[start:start + len(mb)])
        start += len(mb)
    total.backward()
    grad_all = logits.grad.clone()
    logits.grad = None
    whole = loss_of(batch, logits[:3])
    whole.backward()
    assert torch.equal(total.detach(), whole.detach())
    assert torch.equal(grad_all[:3], logits.grad[:3])
    assert torch.count_nonzero(grad_all[3:]) == 0
    # naive loop: the same loss token by token
    lg = logits.detach()
    naive = sum(-float(batch["advantages"][i, t]) * math.exp(float(lg[i, t]) + i)  # old = -i
                for i in range(3) for t in range(4) if bool(batch.mask[i, t]))
    assert abs(float(whole.detach()) - naive) < 1e-12


def test_pad_microbatch_list_validation():
    batch = make_batch([1, 2], [2, 1])
    micros = microbatches_by_count(batch, 1)
    out = pad_microbatch_list(micros, 2, batch)
    assert out is not micros and out[0] is micros[0] and len(out) == 2
    with pytest.raises(InputError) as err:
        pad_microbatch_list(micros, 1, batch)
    assert err.value.key == "target_count"
    with pytest.raises(InputError) as err:
        pad_microbatch_list(micros, -1, batch)
    assert err.value.key == "target_count"
    short = [micros[0].without("old_log_probs"), micros[1]]
    with pytest.raises(InputError) as err:
        pad_microbatch_list(short, 3, batch)
    assert err.value.key == "micros" and "old_log_probs" in str(err.value)
    empty = batch.select([])
    assert len(pad_microbatch_list([], 2, empty)) == 2  # a rank with no rows still runs passes


def test_take_keeps_widths_and_handles_empty_plan():
    batch = make_batch([1, 2, 3], [1, 2, 3], r=5, p=4)
    assert take(batch, []) == []
    (piece,) = take(batch, [torch.tensor([2, 0])])
    assert_rows(piece, batch, [2, 0])
    assert piece.response_width == 5 and piece.prompt_width == 4
    assert piece.kinds["old_log_probs"] == Kind.TOKEN
