"""Context parallelism (CP): which rank of a CP group holds each token of a sequence.

CP divides every sequence's tokens over ``cp`` ranks. Causal attention makes late tokens costlier
than early ones, so the standard split (Megatron-core's ``get_batch_on_this_cp_rank``, verl's
``preprocess_packed_seqs``, TransformerEngine issue 1368) is load-balanced: a row's ``L`` model
tokens (prompt + response, no padding) are padded to ``L_pad``, the next multiple of ``2 * cp``,
and cut into ``2 * cp`` equal chunks of ``L_pad / (2 * cp)`` positions; rank ``r`` holds chunks
``r`` and ``2 * cp - 1 - r`` (rank 0 the first and the last, and so on). A short row leaves
some ranks without any of its tokens.

A response token's loss terms live where its *logit* is: response token ``t`` of a row with a
``p``-token prompt is predicted at position ``p - 1 + t`` (labels are shifted before the split,
as in verl and Megatron), so that position's rank owns it.
"""

from __future__ import annotations

import torch

from rlaudit.errors import InputError


def chunk_rank(positions: torch.Tensor, lengths: torch.Tensor, cp: int) -> torch.Tensor:
    """The CP rank holding each position under the load-balanced split.

    Args:
        positions: [B, T] int positions inside each row (0-based).
        lengths: [B] int, each row's unpadded length L (positions >= L get rank -1).
        cp: the CP group size (>= 1).
    Returns:
        [B, T] int64 ranks in ``0..cp-1``, or -1 outside ``[0, L)``.
    """
    if isinstance(cp, bool) or not isinstance(cp, int) or cp < 1:
        raise InputError(f"expected an integer >= 1, got {cp!r}",
                         key="actor.context_parallel_size")
    lengths = lengths.long().unsqueeze(1)
    chunks = 2 * cp
    padded = (lengths + chunks - 1) // chunks * chunks
    size = (padded // chunks).clamp(min=1)
    chunk = positions.long() // size
    rank = torch.where(chunk < cp, chunk, chunks - 1 - chunk)
    inside = (positions >= 0) & (positions < lengths)
    return torch.where(inside, rank, torch.full_like(rank, -1))


def response_token_ranks(prompt_lengths: torch.Tensor, response_lengths: torch.Tensor,
                         width: int, cp: int) -> torch.Tensor:
    """[B, R] int64: the CP rank owning each response token (the rank of the position whose logit
    predicts it, ``prompt_length - 1 + t``); -1 for ``t >= response_length``."""
    pl, rl = prompt_lengths.long(), response_lengths.long()
    t = torch.arange(width).unsqueeze(0)
    ranks = chunk_rank(pl.unsqueeze(1) - 1 + t, pl + rl, cp)
    return torch.where(t < rl.unsqueeze(1), ranks, torch.full_like(ranks, -1))


__all__ = ["chunk_rank", "response_token_ranks"]
