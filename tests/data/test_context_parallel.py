"""The load-balanced context-parallel split: hand-worked ranks, and the same split rebuilt the
way verl's preprocess_packed_seqs slices a sequence (rank r takes positions half*r..half*(r+1)
and L_pad-half*(r+1)..L_pad-half*r), written here as a loop."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from rlaudit.data.context_parallel import chunk_rank, response_token_ranks
from rlaudit.errors import InputError


def test_hand_worked_cp2():
    # L = 8, cp = 2: 4 chunks of 2 -> ranks 0 0 1 1 1 1 0 0
    # L = 5: padded to 8, chunks of 2 -> 0 0 1 1 1, positions 5.. outside (-1)
    pos = torch.arange(8).unsqueeze(0).expand(2, -1)
    got = chunk_rank(pos, torch.tensor([8, 5]), 2)
    assert got.tolist() == [[0, 0, 1, 1, 1, 1, 0, 0], [0, 0, 1, 1, 1, -1, -1, -1]]


def test_response_tokens_are_owned_by_their_logit_position():
    # prompt 3, response 4: L = 7 -> padded 8 (cp = 2, chunks of 2); response token t is scored
    # at position 2 + t: positions 2, 3, 4, 5 -> ranks 1, 1, 1, 1; t = 4, 5 do not exist
    got = response_token_ranks(torch.tensor([3]), torch.tensor([4]), 6, 2)
    assert got.tolist() == [[1, 1, 1, 1, -1, -1]]
    # cp = 3 on the same row: L_pad = 12, chunks of 2 -> positions 2..5 in chunks 1, 1, 2, 2
    got = response_token_ranks(torch.tensor([3]), torch.tensor([4]), 6, 3)
    assert got.tolist() == [[1, 1, 2, 2, -1, -1]]


def _verl_split(length: int, cp: int) -> list[int]:
    """Rank of each position 0..length-1, by slicing as verl's preprocess_packed_seqs does."""
    padded = -(-length // (2 * cp)) * 2 * cp
    half = padded // (2 * cp)
    owner = [None] * padded
    for r in range(cp):
        for s in range(half * r, half * (r + 1)):
            owner[s] = r
        for s in range(padded - half * (r + 1), padded - half * r):
            owner[s] = r
    return owner[:length]


@given(lengths=st.lists(st.integers(1, 40), min_size=1, max_size=6), cp=st.integers(1, 5))
def test_matches_verl_slicing_and_balances(lengths, cp):
    width = max(lengths)
    pos = torch.arange(width).unsqueeze(0).expand(len(lengths), -1)
    got = chunk_rank(pos, torch.tensor(lengths), cp)
    for i, n in enumerate(lengths):
        assert got[i, :n].tolist() == _verl_split(n, cp)
        assert (got[i, n:] == -1).all()
        # every rank holds at most 2 * ceil(L / 2cp) positions of the row
        counts = torch.bincount(got[i, :n], minlength=cp)
        assert int(counts.max()) <= 2 * -(-n // (2 * cp))


def test_bad_cp_is_an_input_error():
    with pytest.raises(InputError):
        chunk_rank(torch.zeros(1, 1, dtype=torch.long), torch.tensor([1]), 0)
