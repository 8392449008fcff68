"""Naive, loop-based re-implementations the invariants compare against.

Deliberately written differently from rlaudit.algo (Python loops over rows and tokens, float64),
so an invariant that uses them does not share a bug with the code under test.
"""

from __future__ import annotations

import math

import torch

from rlaudit.algo.kl import DEFAULT_K3_CLAMP


def naive_agg(loss_mat: torch.Tensor, mask: torch.Tensor, mode: str,
              norm_len: float | None = None, *, seq_count: str = "valid-rows") -> float:
    """Whole-batch aggregation by loops (docs/internals.md table). ``norm_len`` defaults to R.
    ``seq_count``: the sequence means divide by the rows with a valid token ("valid-rows"), or
    by every row ("all-rows": a target's declared convention, ``actor.loss_seq_count``)."""
    x = loss_mat.double().tolist()
    m = mask.bool().tolist()
    rows = [[v for v, keep in zip(xr, mr) if keep] for xr, mr in zip(x, m)]
    rows_nonempty = [r for r in rows if r]
    if mode == "token-mean":
        n = sum(len(r) for r in rows)
        return sum(sum(r) for r in rows) / n if n else 0.0
    if not rows_nonempty:
        return 0.0
    if seq_count not in ("valid-rows", "all-rows"):
        raise ValueError(f"unknown seq_count {seq_count!r}")
    n_seq = len(rows_nonempty) if seq_count == "valid-rows" else len(rows)
    if mode == "seq-mean-token-sum":
        return sum(sum(r) for r in rows_nonempty) / n_seq
    if mode == "seq-mean-token-mean":
        return sum(sum(r) / len(r) for r in rows_nonempty) / n_seq
    if mode == "seq-mean-token-sum-norm":
        length = float(norm_len if norm_len is not None else loss_mat.shape[-1])
        return sum(sum(r) for r in rows_nonempty) / (n_seq * length)
    raise ValueError(f"unknown aggregation mode {mode!r}")


def naive_token_mean(x: torch.Tensor, mask: torch.Tensor) -> float:
    return naive_agg(x, mask, "token-mean")


def naive_kl(log_prob: torch.Tensor, ref_log_prob: torch.Tensor, kind: str, *,
             k3_clamp: str = DEFAULT_K3_CLAMP) -> torch.Tensor | None:
    """Per-token KL estimate by a loop over elements for k1/kl, abs, k2/mse and k3/low_var_kl
    (log-ratio clamped to [-20, 20], value to [-10, 10] as verl unless ``k3_clamp`` is "none");
    None for other kinds."""
    def one(lp: float, ref: float) -> float:
        d = lp - ref
        if kind in ("k1", "kl"):
            return d
        if kind == "abs":
            return abs(d)
        if kind in ("k2", "mse"):
            return 0.5 * d * d
        r = min(max(ref - lp, -20.0), 20.0)
        k3 = math.exp(r) - r - 1.0
        return k3 if k3_clamp == "none" else min(max(k3, -10.0), 10.0)

    if kind not in ("k1", "kl", "abs", "k2", "mse", "k3", "low_var_kl"):
        return None
    rows = [[one(a, b) for a, b in zip(ra, rb)]
            for ra, rb in zip(log_prob.double().tolist(), ref_log_prob.double().tolist())]
    return torch.tensor(rows, dtype=torch.float64).reshape(log_prob.shape)
