"""On-policy distillation losses (verl's names): ``forward_kl_topk`` and ``k3``.

Inputs come in either of two layouts, with identical results and gradients:

- **padded**: per-token ``[B, R]`` (or ``[B, R, K]`` for top-k) plus ``mask`` ``[B, R]`` (bool or
  0/1; True = the token counts). Values under mask 0 are never read; the result is 0 there.
- **nested**: ``torch.nested`` jagged tensors (``layout=torch.jagged``), row i of shape
  ``[len_i]`` (or ``[len_i, K]``), lengths may be 0. No mask (every stored token counts). The
  result is a nested tensor with the same offsets.

Why the two layouts (verl PR #5997, docs/findings.md, seeds): a data path started delivering
nested tensors and the loss's index ops failed on them. On torch 2.13 ``gather``, ``logsumexp``
and the backward of ``log_softmax`` and ragged ``sum`` do not work on nested tensors, so nested
inputs are computed on their packed values and offsets
(:func:`rlaudit.data.packing.nested_to_packed`), which every op here supports, and the result is
re-wrapped with the same offsets.
"""

from __future__ import annotations

from typing import Callable

import torch

from rlaudit.algo.kl import kl_penalty
from rlaudit.algo.registry import Registry
from rlaudit.data.packing import nested_to_packed
from rlaudit.errors import InputError

DistillLoss = Callable[..., torch.Tensor]
DISTILL_LOSSES: Registry[DistillLoss] = Registry("distillation loss")


def is_nested(x: object) -> bool:
    """True for a jagged nested tensor (the only nested layout accepted)."""
    return isinstance(x, torch.Tensor) and x.is_nested


def _packed(nt: torch.Tensor, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(values [N, ...], offsets [B + 1])`` of a jagged nested tensor (gradients flow back to
    ``nt``), via :func:`rlaudit.data.packing.nested_to_packed`; errors name argument ``name``."""
    try:
        return nested_to_packed(nt)
    except InputError as e:
        raise InputError(e.args[0], key=name) from None


def _unpack_pair(student, teacher, mask, names: tuple[str, str], token_dims: int):
    """Validate a (student, teacher[, mask]) pair. Returns ``(s, t, valid, offsets)``: ``s``,
    ``t`` with token dims flattened to the front (``[N, ...]`` packed, or ``[B, R, ...]``
    padded), ``valid`` a bool mask over the token dims (None when packed) and ``offsets``
    (None when padded). ``token_dims`` = extra trailing dims per token (0 or 1)."""
    nested = [is_nested(student), is_nested(teacher)]
    if nested[0] != nested[1]:
        raise InputError(f"{names[0]} and {names[1]} must both be nested or both padded "
                         f"(got nested={nested[0]} and nested={nested[1]})", key=names[1])
    for x, name in zip((student, teacher), names):
        if not isinstance(x, torch.Tensor) or not x.is_floating_point():
            raise InputError(f"expected a float tensor, got "
                             f"{getattr(x, 'dtype', type(x).__name__)}", key=name)
        if x.dim() != 2 + token_dims:
            want = "[B, R, K]" if token_dims else "[B, R]"
            raise InputError(f"expected {want} (padded or nested), got {x.dim()} dims", key=name)
    if nested[0]:
        if mask is not None:
            raise InputError("nested inputs carry their own lengths: pass mask=None", key="mask")
        s, offs = _packed(student, names[0])
        t, offs_t = _packed(teacher, names[1])
        if not torch.equal(offs.cpu(), offs_t.cpu()) or s.shape != t.shape:
            raise InputError(f"row lengths / shapes differ from {names[0]}: offsets "
                             f"{offs_t.tolist()} vs {offs.tolist()}, values {tuple(t.shape)} vs "
                             f"{tuple(s.shape)}", key=names[1])
        return s, t, None, offs
    if student.shape != teacher.shape:
        raise InputError(f"expected shape {tuple(student.shape)} (as {names[0]}), got "
                         f"{tuple(teacher.shape)}", key=names[1])
    tok_shape = tuple(student.shape[:2])
    if mask is None:
        valid = torch.ones(tok_shape, dtype=torch.bool, device=student.device)
    else:
        if not isinstance(mask, torch.Tensor) or tuple(mask.shape) != tok_shape:
            raise InputError(f"expected shape {tok_shape}, got "
                             f"{tuple(getattr(mask, 'shape', ()))}", key="mask")
        if (mask.dtype != torch.bool and mask.numel()
                and not bool(((mask == 0) | (mask == 1)).all())):
            raise InputError("a non-bool mask must hold only 0 and 1", key="mask")
        valid = mask != 0
    return student, teacher, valid, None


def _finish(loss: torch.Tensor, valid: torch.Tensor | None, offsets: torch.Tensor | None):
    """Re-wrap a packed result as nested, or zero a padded result under mask 0."""
    if offsets is not None:
        return torch.nested.nested_tensor_from_jagged(loss, offsets)
    return torch.where(valid, loss, 0.0)


@DISTILL_LOSSES.register("forward_kl_topk")
def forward_kl_topk(student_topk_log_probs: torch.Tensor, teacher_topk_log_probs: torch.Tensor,
                    mask: torch.Tensor | None = None) -> torch.Tensor:
    """Forward KL restricted to the teacher's top-k tokens:
    ``loss[b, t] = sum_k p_T(k) * (log p_T(k) - log p_S(k))``, ``p_T = exp(teacher log-prob)``,
    sum over the K ids (no renormalisation of the top-k mass). A teacher entry with
    ``p_T = 0`` (log-prob -inf, e.g. K > vocab padding) contributes 0 (0 log 0 = 0).

    Args:
        student_topk_log_probs: [B, R, K] (or nested [B, j, K]) the student's log-probs at the
            teacher's top-k ids (see :func:`gather_topk`); carries the gradient.
        teacher_topk_log_probs: same shape, the teacher's log-probs of those ids.
        mask: [B, R] for padded inputs (None = all valid); must be None for nested inputs.

    Returns: ``loss_mat`` [B, R] (0 under mask 0) or nested [B, j] with the inputs' offsets.
    """
    s, t, valid, offs = _unpack_pair(student_topk_log_probs, teacher_topk_log_probs, mask,
                                     ("student_topk_log_probs", "teacher_topk_log_probs"), 1)
    if valid is not None:
        # Zero the padding first: NaN/inf there must reach neither the value nor the gradient.
        s = torch.where(valid.unsqueeze(-1), s, 0.0)
        t = torch.where(valid.unsqueeze(-1), t, 0.0)
    p_t = torch.exp(t)
    present = p_t > 0
    term = p_t * (torch.where(present, t, 0.0) - torch.where(present, s, 0.0))
    return _finish(torch.where(present, term, 0.0).sum(-1), valid, offs)


@DISTILL_LOSSES.register("k3")
def k3(student_log_probs: torch.Tensor, teacher_log_probs: torch.Tensor,
       mask: torch.Tensor | None = None) -> torch.Tensor:
    """Per-token k3 estimate of KL(student || teacher) on the sampled token:
    ``kl_penalty(student, teacher, "k3")`` = ``exp(t - s) - (t - s) - 1`` (>= 0), with
    :mod:`rlaudit.algo.kl`'s clamps (verl's): the value is capped at 10 (zero gradient there).

    Args:
        student_log_probs: [B, R] (or nested [B, j]) the student's log-prob of each sampled
            token; carries the gradient.
        teacher_log_probs: same shape, the teacher's log-prob of the same tokens.
        mask: [B, R] for padded inputs (None = all valid); must be None for nested inputs.

    Returns: ``loss_mat`` [B, R] (0 under mask 0) or nested [B, j] with the inputs' offsets.
    """
    s, t, valid, offs = _unpack_pair(student_log_probs, teacher_log_probs, mask,
                                     ("student_log_probs", "teacher_log_probs"), 0)
    if valid is not None:
        s = torch.where(valid, s, 0.0)
        t = torch.where(valid, t, 0.0)
    else:                              # packed [N]: the estimator sees a [1, N] batch
        s, t = s.unsqueeze(0), t.unsqueeze(0)
    loss = kl_penalty(s, t, "k3")
    return _finish(loss if valid is not None else loss.squeeze(0), valid, offs)


def compute_distill_loss(name: str, student: torch.Tensor, teacher: torch.Tensor,
                         mask: torch.Tensor | None = None) -> torch.Tensor:
    """``DISTILL_LOSSES.get(name)(student, teacher, mask)``; unknown names raise
    ``UnknownNameError`` naming ``actor.distill.loss_type``."""
    fn = DISTILL_LOSSES.get(name, key="actor.distill.loss_type")
    return fn(student, teacher, mask)


def gather_topk(log_probs: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """The student's log-probs at the teacher's top-k ids: ``out[..., k] = log_probs[..., ids[k]]``.

    Args:
        log_probs: [B, R, V] full-vocabulary log-probs, or nested [B, j, V].
        topk_ids: [B, R, K] int ids in [0, V), or nested [B, j, K] with the same offsets.

    Returns: [B, R, K] (padded) or nested [B, j, K]; differentiable w.r.t. ``log_probs``.
    Padded rows' ids under the mask must still be valid indices (use 0 for padding).
    """
    if is_nested(log_probs) != is_nested(topk_ids):
        raise InputError("log_probs and topk_ids must both be nested or both padded",
                         key="topk_ids")
    if topk_ids.is_floating_point() or topk_ids.dim() != 3 or log_probs.dim() != 3:
        raise InputError(f"expected integer ids [B, R, K] and log-probs [B, R, V], got "
                         f"{topk_ids.dtype} {topk_ids.dim()} dims and {log_probs.dim()} dims",
                         key="topk_ids")
    if is_nested(log_probs):
        lp, offs = _packed(log_probs, "log_probs")
        ids, offs_i = _packed(topk_ids, "topk_ids")
        if not torch.equal(offs.cpu(), offs_i.cpu()):
            raise InputError("row lengths differ from log_probs", key="topk_ids")
    else:
        lp, ids, offs = log_probs, topk_ids, None
        if lp.shape[:2] != ids.shape[:2]:
            raise InputError(f"expected leading dims {tuple(lp.shape[:2])}, got "
                             f"{tuple(ids.shape[:2])}", key="topk_ids")
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= lp.shape[-1]):
        raise InputError(f"ids must be in [0, V={lp.shape[-1]}), got [{int(ids.min())}, "
                         f"{int(ids.max())}]", key="topk_ids")
    out = torch.gather(lp, -1, ids.long())
    return torch.nested.nested_tensor_from_jagged(out, offs) if offs is not None else out
