"""Log-probs and entropy from logits split over the vocabulary across a tensor-parallel group.

Under tensor parallelism the last stage holds ``logits_shard [..., Vs]``: rank ``r`` of the TP group
has the columns of global token ids ``[r*Vs, (r+1)*Vs)``. Columns with global id >= ``vocab_size``
are padding (megatron pads the vocab to a multiple of TP) and are excluded everywhere: they add
nothing to the partition function, the entropy or the gradient.

With ``z = logits / temperature`` and ``p = softmax(z)`` over the real vocabulary:

    logp[i]    = z[i, label_i] - logsumexp(z[i, :])
    entropy[i] = logsumexp(z[i, :]) - sum_v p[i, v] z[i, v]         (= -sum_v p log p)

Communication per call: one all-gather of each rank's ``[..., 4]`` statistics of its own shard
(its max ``m_r``, ``sum exp(z - m_r)``, ``sum exp(z - m_r) (z - m_r)`` and the label's logit if it owns
it), combined the way an online softmax is: with ``m = max_r m_r`` and ``c_r = exp(m_r - m)``,

    sum_v exp(z_v - m)             = sum_r c_r s_r
    sum_v exp(z_v - m) (z_v - m)   = sum_r c_r (u_r + s_r (m_r - m))

(a shard with nothing real in it has ``s_r = u_r = 0`` and contributes 0). One collective where a
max then a sum would be two: on a CPU box every gloo collective costs about a millisecond of
wake-ups. The backward needs no communication: with the combined statistics saved, each rank's
gradient for its own columns is local:

    d logp / d z_v    = 1[v == label] - p_v
    d entropy / d z_v = -p_v (z_v - sum_u p_u z_u)

Unlike megatron's ``vocab_parallel_cross_entropy`` (which overwrites its logits input in place), the
input is never modified and the outputs never alias it. ``tp_group=None`` means no tensor
parallelism (the shard is the whole vocabulary, no communication) -- handy on one process.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from rlaudit.errors import InputError

_UPCAST = (torch.float16, torch.bfloat16)  # reduced in float32: exp/sum lose too much in 16 bits


def _group_rank_size(group) -> tuple[int, int]:
    if group is None:
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def _all_reduce(t: torch.Tensor, op, group) -> torch.Tensor:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(t, op=op, group=group)
    return t


def _prepare(logits_shard: torch.Tensor, *, temperature: float, tp_group, vocab_size: int | None):
    """``(z_valid [..., n_valid] new tensor, first global id of the shard)``."""
    if not isinstance(temperature, (int, float)) or not temperature > 0:
        raise InputError(f"expected a positive number, got {temperature!r}", key="temperature")
    rank, size = _group_rank_size(tp_group)
    width = logits_shard.shape[-1]
    vocab = width * size if vocab_size is None else vocab_size
    if not 0 < vocab <= width * size:
        raise InputError(f"expected 0 < vocab_size <= {width * size} (shard width {width} x tp "
                         f"{size}), got {vocab}", key="vocab_size")
    start = rank * width
    n_valid = max(0, min(width, vocab - start))
    dtype = torch.float32 if logits_shard.dtype in _UPCAST else logits_shard.dtype
    z = logits_shard[..., :n_valid].to(dtype) / temperature  # division: always a new tensor
    return z, start, vocab


def _check_ids(ids: torch.Tensor, vocab: int, name: str) -> None:
    if ids.dtype.is_floating_point or ids.dtype == torch.bool:
        raise InputError(f"expected an integer tensor, got {ids.dtype}", key=name)
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
        raise InputError(f"token ids must lie in [0, {vocab}), got range "
                         f"[{int(ids.min())}, {int(ids.max())}]", key=name)


def _global_max(z: torch.Tensor, group) -> torch.Tensor:
    """Max over the whole (sharded) vocab, ``[...]``; an all-padding shard contributes -inf."""
    if z.shape[-1]:
        m = z.detach().amax(dim=-1)
    else:
        m = torch.full(z.shape[:-1], float("-inf"), dtype=z.dtype, device=z.device)
    return _all_reduce(m, dist.ReduceOp.MAX, group)


def _shard_stats(z: torch.Tensor, local: torch.Tensor, owned: torch.Tensor, *,
                 calc_entropy: bool) -> torch.Tensor:
    """``[..., 4]``, this shard's: max ``m_r``, ``sum exp(z - m_r)``, ``sum exp(z - m_r) (z - m_r)``
    (0 without ``calc_entropy``: not computed) and the logit of the label at column ``local``
    where this shard ``owned`` it (else 0). A shard with no column has ``m_r = -inf`` and 0s."""
    if not z.shape[-1]:
        m = torch.full(z.shape[:-1], float("-inf"), dtype=z.dtype, device=z.device)
        zero = torch.zeros_like(m)
        return torch.stack([m, zero, zero, zero], dim=-1)
    z = z.detach()
    m = z.amax(dim=-1)
    zc = z - m.unsqueeze(-1)
    e = zc.exp()
    picked = z.gather(-1, local.clamp(0, z.shape[-1] - 1).unsqueeze(-1)).squeeze(-1)
    target = torch.where(owned, picked, torch.zeros_like(picked))
    u = (e * zc).sum(-1) if calc_entropy else torch.zeros_like(m)
    return torch.stack([m, e.sum(-1), u, target], dim=-1)


def _gather(stats: torch.Tensor, group) -> list[torch.Tensor]:
    """Every TP rank's ``stats``, in rank order (one all-gather)."""
    if group is None or dist.get_world_size(group) == 1:
        return [stats]
    parts = [torch.empty_like(stats) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, stats.contiguous(), group=group)
    return parts


def _combine(parts: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """``(m, sum exp(z - m), sum exp(z - m) (z - m), label logit)`` over the whole vocab from
    every shard's :func:`_shard_stats`, summed in the order given (the same on every rank)."""
    m = torch.stack([p[..., 0] for p in parts]).amax(dim=0)   # finite: some shard has real columns
    sum_exp = torch.zeros_like(m)
    sum_ezc = torch.zeros_like(m)
    target = torch.zeros_like(m)
    for p in parts:
        m_r, s_r, u_r = p[..., 0], p[..., 1], p[..., 2]
        real = s_r > 0                                          # an all-padding shard adds nothing
        shift = torch.where(real, m_r - m, torch.zeros_like(m))
        c_r = torch.where(real, shift.exp(), torch.zeros_like(m))
        sum_exp = sum_exp + c_r * s_r
        sum_ezc = sum_ezc + c_r * (u_r + s_r * shift)
        target = target + p[..., 3]
    return m, sum_exp, sum_ezc, target


class _VocabParallelLogpEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, z, labels, start, calc_entropy, group):
        local = labels - start
        owned = (local >= 0) & (local < z.shape[-1])
        stats = _shard_stats(z, local, owned, calc_entropy=calc_entropy)
        m, sum_exp, sum_ezc, target = _combine(_gather(stats, group))
        log_z = sum_exp.log()                                      # logsumexp(z) - m
        logp = (target - m) - log_z
        entropy = None
        mean_zc = torch.zeros_like(log_z)                          # unused without entropy
        if calc_entropy:
            mean_zc = sum_ezc / sum_exp                            # E_p[z - m]
            entropy = log_z - mean_zc
        ctx.save_for_backward(z, m, log_z, mean_zc, local, owned)  # z: no copy, zc is rebuilt
        return logp, entropy

    @staticmethod
    def backward(ctx, g_logp, g_entropy):
        z, m, log_z, mean_zc, local, owned = ctx.saved_tensors
        zc = z - m.unsqueeze(-1)
        p = (zc - log_z.unsqueeze(-1)).exp()
        grad = torch.zeros_like(zc)
        if g_logp is not None:
            grad = grad - p * g_logp.unsqueeze(-1)
            if zc.shape[-1]:
                hit = torch.where(owned, g_logp, torch.zeros_like(g_logp))
                grad = grad.scatter_add(-1, local.clamp(0, zc.shape[-1] - 1).unsqueeze(-1),
                                        hit.unsqueeze(-1))
        if g_entropy is not None:
            grad = grad - p * (zc - mean_zc.unsqueeze(-1)) * g_entropy.unsqueeze(-1)
        return grad, None, None, None, None


def vocab_parallel_logprobs_entropy(logits_shard: torch.Tensor, labels: torch.Tensor, *,
                                    temperature: float = 1.0, calc_entropy: bool = False,
                                    tp_group=None, vocab_size: int | None = None
                                    ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-position log-prob of ``labels`` and (optionally) entropy, from vocab-sharded logits.

    ``logits_shard``: ``[..., Vs]``, this rank's vocab slice: global ids ``[rank*Vs, (rank+1)*Vs)``.
    ``labels``: ``[...]`` integer global token ids in ``[0, vocab_size)`` at *every* position
    (no ignore index: fill padded positions with any valid id and mask the result).
    ``vocab_size``: the real vocabulary size; columns at or beyond it are excluded (default: all
    ``Vs * tp`` columns are real). Logits of real columns must be finite.

    Returns ``(logp [...], entropy [...] or None)``, new tensors in the logits' dtype (16-bit
    logits are reduced in float32, then cast back, as ``rlaudit.algo.logprob`` does), identical
    on every rank of ``tp_group``. Differentiable w.r.t. ``logits_shard``: each rank receives the
    gradient of its own columns, padding columns get 0.
    Reductions are over the vocabulary only; nothing is averaged over positions.
    Collective: every rank of ``tp_group`` must call it with the same ``labels``.
    """
    z, start, vocab = _prepare(logits_shard, temperature=temperature, tp_group=tp_group,
                               vocab_size=vocab_size)
    if labels.shape != logits_shard.shape[:-1]:
        raise InputError(f"expected shape {tuple(logits_shard.shape[:-1])} (logits without the "
                         f"vocab dim), got {tuple(labels.shape)}", key="labels")
    _check_ids(labels, vocab, "labels")
    logp, entropy = _VocabParallelLogpEntropy.apply(z, labels, start, bool(calc_entropy), tp_group)
    out_dtype = logits_shard.dtype
    return logp.to(out_dtype), (entropy.to(out_dtype) if calc_entropy else None)


class _SumIdentityBackward(torch.autograd.Function):
    """All-reduce(SUM) over ``group`` in forward; identity in backward.

    Right when every rank then computes the same (replicated) loss from the sum: each rank's
    upstream gradient already is d loss / d sum, so summing gradients would count it ``tp`` times.
    """

    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x.clone(), dist.ReduceOp.SUM, group)

    @staticmethod
    def backward(ctx, g):
        return g, None


def vocab_parallel_log_probs_at(logits_shard: torch.Tensor, ids: torch.Tensor, *,
                                temperature: float = 1.0, tp_group=None,
                                vocab_size: int | None = None) -> torch.Tensor:
    """Log-probs of ``K`` given token ids per position (e.g. a teacher's top-k), vocab-sharded.

    ``logits_shard``: ``[..., Vs]`` as in :func:`vocab_parallel_logprobs_entropy`; ``ids``:
    ``[..., K]`` global ids in ``[0, vocab_size)``. Returns new ``[..., K]`` log-probs (log-softmax
    over the real vocabulary), identical on every TP rank, differentiable w.r.t. the shard.
    """
    z, start, vocab = _prepare(logits_shard, temperature=temperature, tp_group=tp_group,
                               vocab_size=vocab_size)
    if ids.dim() != logits_shard.dim() or ids.shape[:-1] != logits_shard.shape[:-1]:
        raise InputError(f"expected shape {tuple(logits_shard.shape[:-1])} + (K,), got "
                         f"{tuple(ids.shape)}", key="ids")
    _check_ids(ids, vocab, "ids")
    m = _global_max(z, tp_group).unsqueeze(-1)           # a constant shift: no gradient needed
    zc = z - m
    log_z = _SumIdentityBackward.apply(zc.exp().sum(-1, keepdim=True), tp_group).log()
    local = ids - start
    owned = (local >= 0) & (local < z.shape[-1])
    if z.shape[-1]:
        picked = zc.gather(-1, local.clamp(0, z.shape[-1] - 1))
        picked = torch.where(owned, picked, torch.zeros_like(picked))
    else:
        picked = zc.new_zeros(ids.shape)
    return (_SumIdentityBackward.apply(picked, tp_group) - log_z).to(logits_shard.dtype)
