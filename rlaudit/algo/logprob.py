"""Log-probabilities and entropy from logits, chunked over rows so that large vocabularies fit.

A policy's per-token log-prob of the sampled token and the entropy of its next-token
distribution are what every RL loss starts from. Computed naively (``log_softmax`` then
``gather``, ``-(p * logp).sum(-1)``) they allocate several tensors as large as the logits
(``[tokens, V]`` with V ~ 150k), forward and backward. Here rows are processed ``chunk_size``
at a time by one ``torch.autograd.Function``:

- forward keeps, per row, only the log-sum-exp and the entropy (``[N]`` each);
- backward recomputes the softmax chunk by chunk and writes the gradient into one
  preallocated ``[N, V]`` tensor (the gradient autograd has to return anyway).

Peak extra memory is therefore about 1.25 ``[chunk_size, V]`` buffers in the compute dtype
(one chunk of shifted logits plus a quarter-chunk of exponentials), independent of the number of
rows; backward adds the ``[N, V]`` gradient itself (measured by
``benchmarks/logprob_entropy.py``).

Temperature is applied as rollout engines apply it for their "processed" log-probs (vLLM
``logprobs_mode="processed_logprobs"``): logits are divided by ``T`` before the softmax, and the
entropy is that of ``softmax(logits / T)``.

Half-precision logits (fp16/bf16) are upcast to float32 chunk by chunk; float32 and float64 are
computed in their own dtype. Outputs have the logits' dtype.

Every row must contain at least one finite logit. Entries equal to ``-inf`` (a masked vocabulary)
are allowed: they have probability 0, contribute 0 to the entropy and get a 0 gradient.
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from rlaudit.errors import InputError

__all__ = ["logprobs_from_logits", "entropy_from_logits", "log_probs_at"]

#: Shifted log-probs below this are clamped before being multiplied by a probability: exp() of
#: anything below about -745 is exactly 0 even in float64, so the clamp changes no result, but it
#: turns 0 * (-inf) (a NaN) into 0 * (-1e4) for masked (-inf) vocabulary entries.
_LOGP_FLOOR = -1.0e4

#: Default rows per chunk. Peak extra memory is about 1.25 * chunk_size * V * 4 bytes with
#: float32 compute (see _SUB_BLOCKS): ~0.19 GiB for V = 151936 — measured 8% of the logits of a
#: [4096, 151936] float32 batch forward (7% forward+backward, beside the logits gradient), at
#: 0.24-0.28x the naive time (benchmarks/logprob_entropy.py). 1024 rows measured 32% / 25%.
DEFAULT_CHUNK_SIZE = 256

#: The second working buffer (exp of the shifted logits) covers a quarter of a chunk at a time,
#: so a chunk costs ~1.25 instead of 2 row-buffers; more sub-blocks would add kernel launches
#: for little memory.
_SUB_BLOCKS = 4


def _sub_rows(chunk_rows: int) -> int:
    """Rows of the sub-block buffer for a chunk of ``chunk_rows`` rows (>= 1)."""
    return max(1, -(-chunk_rows // _SUB_BLOCKS))


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp16/bf16 are upcast to float32 per chunk; float32/float64 are kept."""
    if dtype in (torch.float16, torch.bfloat16):
        return torch.float32
    if dtype in (torch.float32, torch.float64):
        return dtype
    raise InputError(f"expected a floating-point tensor, got dtype {dtype}", key="logits")


def _forward_stats(rows: torch.Tensor, ids: torch.Tensor, temperature: float, chunk_size: int,
                   want_entropy: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-row statistics of ``softmax(rows / temperature)``, chunk by chunk.

    Args:
        rows: ``[N, V]`` logits (read only).
        ids: ``[N, K]`` int64 vocabulary ids (K may be 0).
    Returns:
        ``(logp [N, K], lse [N], entropy [N])`` in the compute dtype, where ``logp[n, k]`` is
        the log-probability of ``ids[n, k]``, ``lse`` the log-sum-exp of ``rows / T`` and
        ``entropy`` is ``-sum_v p_v log p_v`` (a sum over the whole vocabulary; zeros when
        ``want_entropy`` is False).
    """
    n, v = rows.shape
    cdt = _compute_dtype(rows.dtype)
    logp = torch.empty(ids.shape, dtype=cdt, device=rows.device)
    lse = torch.empty(n, dtype=cdt, device=rows.device)
    entropy = torch.zeros(n, dtype=cdt, device=rows.device)
    if n == 0:
        return logp, lse, entropy
    c = min(chunk_size, n)
    sub = _sub_rows(c)
    shifted = torch.empty((c, v), dtype=cdt, device=rows.device)    # x/T - max(x/T)
    expd = torch.empty((sub, v), dtype=cdt, device=rows.device)     # exp(shifted), sub-block
    sum_exp = torch.empty(c, dtype=cdt, device=rows.device)         # S = sum_v exp(shifted)
    sum_ey = torch.zeros(c, dtype=cdt, device=rows.device)          # sum_v exp(shifted) * shifted
    for s in range(0, n, c):
        e = min(s + c, n)
        x, y = rows[s:e], shifted[: e - s]
        # max(x / T) = max(x) / T for T > 0; subtracting it makes exp() safe.
        m = x.amax(dim=-1, keepdim=True).to(cdt)
        torch.sub(x, m, out=y)
        if temperature != 1.0:
            y.div_(temperature)
        logp[s:e] = y.gather(1, ids[s:e])            # before the clamp: -inf stays -inf
        y.clamp_(min=_LOGP_FLOOR)
        for a in range(0, e - s, sub):
            b = min(a + sub, e - s)
            ex = torch.exp(y[a:b], out=expd[: b - a])
            sum_exp[a:b] = ex.sum(dim=-1)
            if want_entropy:
                sum_ey[a:b] = ex.mul_(y[a:b]).sum(dim=-1)
        log_sum = sum_exp[: e - s].log()
        logp[s:e] -= log_sum.unsqueeze(-1)
        lse[s:e] = m.squeeze(-1) / temperature + log_sum
        if want_entropy:
            # H = -sum p (y - log S) with p = exp(y) / S  ==  log S - sum(exp(y) * y) / S
            entropy[s:e] = log_sum - sum_ey[: e - s] / sum_exp[: e - s]
    return logp, lse, entropy


class _ChunkedLogSoftmaxStats(torch.autograd.Function):
    """``(logits [N, V], ids [N, K]) -> (logp [N, K], entropy [N])`` of ``softmax(logits / T)``.

    Saves only the logits reference (no copy), ``ids`` and two ``[N]`` vectors; the backward
    pass recomputes probabilities chunk by chunk.
    """

    @staticmethod
    def forward(ctx, rows, ids, temperature, chunk_size, want_entropy):
        logp, lse, entropy = _forward_stats(rows, ids, temperature, chunk_size, want_entropy)
        ctx.save_for_backward(rows, ids, lse, entropy)
        ctx.temperature = temperature
        ctx.chunk_size = chunk_size
        ctx.want_entropy = want_entropy
        ctx.set_materialize_grads(False)  # an unused output's gradient arrives as None
        if not want_entropy:
            ctx.mark_non_differentiable(entropy)
        return logp.to(rows.dtype), entropy.to(rows.dtype)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_logp, grad_entropy):
        rows, ids, lse, entropy = ctx.saved_tensors
        if not ctx.needs_input_grad[0]:
            return None, None, None, None, None
        t, c = ctx.temperature, ctx.chunk_size
        n, v = rows.shape
        cdt = lse.dtype
        grad = torch.empty((n, v), dtype=rows.dtype, device=rows.device)
        if n == 0:
            return grad, None, None, None, None
        # d logp_k / d x_j = [j == id_k] - p_j ;  d H / d x_j = -p_j (log p_j + H)
        # d/d logits = (1/T) * d/dx, with x = logits / T.
        g_lp = (torch.zeros(ids.shape, dtype=cdt, device=rows.device) if grad_logp is None
                else grad_logp.to(cdt))
        g_lp_sum = g_lp.sum(dim=-1, keepdim=True)
        g_h = (None if grad_entropy is None or not ctx.want_entropy
               else grad_entropy.to(cdt).unsqueeze(-1))
        c = min(c, n)
        sub = _sub_rows(c)
        logp_buf = torch.empty((c, v), dtype=cdt, device=rows.device)
        # Probabilities go straight into the gradient when dtypes agree; otherwise through a
        # sub-block buffer in the compute dtype (1 - p at the label needs its precision).
        p_buf = None if rows.dtype == cdt else torch.empty((sub, v), dtype=cdt, device=rows.device)
        for s in range(0, n, c):
            e = min(s + c, n)
            lp = logp_buf[: e - s]
            torch.sub(rows[s:e], (lse[s:e] * t).unsqueeze(-1), out=lp)
            if t != 1.0:
                lp.div_(t)                               # log p = (x - T*lse) / T
            lp.clamp_(min=_LOGP_FLOOR)
            for a in range(s, e, sub):
                b = min(a + sub, e)
                lpb = lp[a - s: b - s]
                p = grad[a:b] if p_buf is None else p_buf[: b - a]
                torch.exp(lpb, out=p)
                # grad_j = -p_j * w_j + scatter(g),  w_j = sum_k g_k + g_H * (log p_j + H)
                if g_h is not None:
                    lpb.add_(entropy[a:b].unsqueeze(-1)).mul_(g_h[a:b]).add_(g_lp_sum[a:b])
                    p.mul_(lpb)
                else:
                    p.mul_(g_lp_sum[a:b])
                p.neg_()
                p.scatter_add_(1, ids[a:b], g_lp[a:b])
                if t != 1.0:
                    p.div_(t)
                if p_buf is not None:
                    grad[a:b] = p
        return grad, None, None, None, None


def _check_args(logits: torch.Tensor, temperature: float, chunk_size: int) -> None:
    if not isinstance(logits, torch.Tensor) or logits.dim() < 1:
        raise InputError("expected a tensor [..., V] with at least one dimension", key="logits")
    if logits.shape[-1] == 0:
        raise InputError("vocabulary dimension V is 0", key="logits")
    _compute_dtype(logits.dtype)
    if not (isinstance(temperature, (int, float)) and temperature > 0):
        raise InputError(f"must be a number > 0, got {temperature!r}", key="temperature")
    if not (isinstance(chunk_size, int) and chunk_size >= 1):
        raise InputError(f"must be an int >= 1, got {chunk_size!r}", key="chunk_size")


def _check_ids(ids: torch.Tensor, v: int, key: str) -> torch.Tensor:
    if ids.dtype.is_floating_point or ids.dtype == torch.bool or ids.is_complex():
        raise InputError(f"expected an integer tensor, got dtype {ids.dtype}", key=key)
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= v):
        raise InputError(f"ids must lie in [0, {v}), got range [{int(ids.min())}, "
                         f"{int(ids.max())}]", key=key)
    return ids.to(torch.int64)


def _rows(logits: torch.Tensor) -> torch.Tensor:
    """``[..., V] -> [N, V]``: a view when the leading dims can be merged, else one copy."""
    return logits.reshape(-1, logits.shape[-1])


def _apply(logits, ids2d, temperature, chunk_size, want_entropy):
    return _ChunkedLogSoftmaxStats.apply(_rows(logits), ids2d, float(temperature), chunk_size,
                                         want_entropy)


def logprobs_from_logits(logits: torch.Tensor, labels: torch.Tensor, *, temperature: float = 1.0,
                         calc_entropy: bool = False, chunk_size: int = DEFAULT_CHUNK_SIZE,
                         ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-prob of each label and (optionally) the entropy, under ``softmax(logits / T)``.

    Args:
        logits: ``[..., V]`` any float dtype; not modified. Leading dims that cannot be merged
            into one (a strided slice) cost one copy of the logits.
        labels: ``[...]`` integer ids in ``[0, V)``, the shape of ``logits`` without ``V``.
        temperature: ``T > 0``; logits are divided by it before the softmax.
        calc_entropy: also return the entropy.
        chunk_size: rows (flattened leading positions) processed at a time.
    Returns:
        ``(logp, entropy)``, both shaped like ``labels`` in ``logits.dtype``:
        ``logp = log softmax(logits / T)[label]`` and ``entropy = -sum_v p_v log p_v`` (a sum
        over the vocabulary, no mean), or ``None`` when ``calc_entropy`` is False. No position
        is masked: every position gets a value; the caller applies the response mask.
        Both are differentiable w.r.t. ``logits``.
    """
    _check_args(logits, temperature, chunk_size)
    if tuple(labels.shape) != tuple(logits.shape[:-1]):
        raise InputError(f"shape {tuple(labels.shape)} must equal logits.shape[:-1] = "
                         f"{tuple(logits.shape[:-1])}", key="labels")
    ids = _check_ids(labels, logits.shape[-1], "labels").reshape(-1, 1)
    logp, ent = _apply(logits, ids, temperature, chunk_size, calc_entropy)
    logp = logp.reshape(labels.shape)
    return logp, (ent.reshape(labels.shape) if calc_entropy else None)


def entropy_from_logits(logits: torch.Tensor, *, temperature: float = 1.0,
                        chunk_size: int = DEFAULT_CHUNK_SIZE) -> torch.Tensor:
    """Entropy ``-sum_v p_v log p_v`` of ``softmax(logits / T)`` per position.

    Args:
        logits: ``[..., V]`` any float dtype; not modified.
    Returns:
        ``[...]`` in ``logits.dtype`` (a sum over the vocabulary, no mask), differentiable.
    """
    _check_args(logits, temperature, chunk_size)
    n = logits.numel() // logits.shape[-1]
    ids = torch.empty((n, 0), dtype=torch.int64, device=logits.device)
    _, ent = _apply(logits, ids, temperature, chunk_size, True)
    return ent.reshape(logits.shape[:-1])


def log_probs_at(logits: torch.Tensor, ids: torch.Tensor, *, temperature: float = 1.0,
                 chunk_size: int = DEFAULT_CHUNK_SIZE) -> torch.Tensor:
    """Log-probs of several vocabulary ids per position (e.g. a teacher's top-k ids).

    Args:
        logits: ``[..., V]`` any float dtype; not modified.
        ids: ``[..., K]`` integer ids in ``[0, V)``; leading dims equal ``logits.shape[:-1]``.
            Repeated ids are allowed (each gets its own, equal, entry).
    Returns:
        ``[..., K]`` in ``logits.dtype``: ``log softmax(logits / T)`` at each id (no mask),
        differentiable w.r.t. ``logits``.
    """
    _check_args(logits, temperature, chunk_size)
    if ids.dim() != logits.dim() or tuple(ids.shape[:-1]) != tuple(logits.shape[:-1]):
        raise InputError(f"shape {tuple(ids.shape)} must be logits.shape[:-1] + (K,) = "
                         f"{tuple(logits.shape[:-1])} + (K,)", key="ids")
    n = logits.numel() // logits.shape[-1]
    ids2d = _check_ids(ids, logits.shape[-1], "ids").reshape(n, ids.shape[-1])
    logp, _ = _apply(logits, ids2d, temperature, chunk_size, False)
    return logp.reshape(ids.shape)
