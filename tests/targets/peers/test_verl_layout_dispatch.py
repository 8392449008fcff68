"""verl_layout.dispatch_order: the row order that makes verl's per-rank mini-batches the
reference's (hand-worked)."""

import pytest

from rlaudit.targets.peers.verl_layout import dispatch_order


def test_dp1_keeps_the_rollout_order():
    assert dispatch_order(8, 4, 1) == list(range(8))


def test_dp2_two_mini_batches():
    # 16 rows, mini-batches of 8: rank 0's chunk holds 0-3 (step 0) and 8-11 (step 1)
    assert dispatch_order(16, 8, 2) == [0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15]


def test_every_step_trains_the_reference_rows():
    rows, mini, dp = 24, 12, 3
    order = dispatch_order(rows, mini, dp)
    chunk, m = rows // dp, mini // dp
    for k in range(rows // mini):        # what step k trains, rank by rank, as verl cuts it
        trained = sorted(order[r * chunk + k * m + j] for r in range(dp) for j in range(m))
        assert trained == list(range(k * mini, (k + 1) * mini))
    assert sorted(order) == list(range(rows))


def test_one_mini_batch_is_a_permutation_of_nothing_that_matters():
    assert sorted(dispatch_order(8, 8, 2)[:4]) == [0, 1, 2, 3]


def test_rows_that_do_not_cut_are_refused():
    with pytest.raises(ValueError, match="do not cut"):
        dispatch_order(10, 4, 2)
    with pytest.raises(ValueError, match="do not cut"):
        dispatch_order(12, 6, 4)
