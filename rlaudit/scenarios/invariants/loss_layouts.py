"""Loss layouts: call a loss function directly on inputs shaped like the scenario's batch, laid
out padded and nested, and compare.

``check_nested_losses`` is the nested-matches-padded invariant (verl PR #5997): the same per-token
inputs as a padded [B, R(, K)] tensor with a mask and as a jagged nested tensor must give the
same per-token losses and the same gradients. The functions checked default to the reference
implementations; rlaudit.targets passes an adapter's instead.
"""

from __future__ import annotations

from typing import Callable

import torch

from rlaudit.algo.distill import DISTILL_LOSSES
from rlaudit.data.packing import nested_to_padded, padded_to_nested
from rlaudit.verdict.result import FAIL, PASS, CheckResult

#: top-k width of the synthetic teacher distribution
TOPK = 4
NESTED_ATOL = 1e-12


def distill_inputs(lengths: torch.Tensor, width: int, seed: int = 0):
    """Synthetic distillation inputs for rows of ``lengths`` valid tokens, padded to ``width``:
    (student top-k [B, width, TOPK], teacher top-k [B, width, TOPK], student [B, width], teacher
    [B, width]) log-probs, float64, from ``seed``; entries past a row's length are filled too
    (the caller's mask says which count)."""
    g = torch.Generator().manual_seed(seed)
    b = lengths.numel()
    logits_s = torch.randn(b, width, TOPK + 3, generator=g, dtype=torch.float64)
    logits_t = torch.randn(b, width, TOPK + 3, generator=g, dtype=torch.float64)
    s_full = torch.log_softmax(logits_s, -1)
    t_full = torch.log_softmax(logits_t, -1)
    return s_full[..., :TOPK], t_full[..., :TOPK], s_full[..., 0], t_full[..., 0]


def default_losses() -> dict[str, tuple[Callable, bool]]:
    """name -> (fn(student, teacher, mask) -> per-token loss, uses top-k [.., K] inputs)."""
    losses = {f"distill:{n}": (DISTILL_LOSSES.get(n), n == "forward_kl_topk")
              for n in DISTILL_LOSSES}
    return losses


def _grads(fn, student, teacher, mask, lengths, nested: bool):
    s = student.detach().clone().requires_grad_(True)
    if nested:
        sn = padded_to_nested(s, lengths)
        tn = padded_to_nested(teacher, lengths)
        out = fn(sn, tn, None)
        padded = nested_to_padded(out, width=student.shape[1])
        total = out.values().sum()
    else:
        padded = fn(s, teacher, mask)
        total = (padded * mask).sum()
    total.backward()
    return padded.detach(), s.grad.detach()


def check_nested_losses(ctx, backend: str, losses: dict | None = None) -> CheckResult:
    lengths = ctx.batch["response_lengths"].long()
    width = ctx.batch.response_width
    cols = torch.arange(width).unsqueeze(0)
    mask = cols < lengths.unsqueeze(1)
    s_k, t_k, s_1, t_1 = distill_inputs(lengths, width)
    losses = losses or default_losses()
    problems, checked = [], []
    for name, (fn, topk) in losses.items():
        s, t = (s_k, t_k) if topk else (s_1, t_1)
        try:
            val_p, grad_p = _grads(fn, s, t, mask, lengths, nested=False)
            val_n, grad_n = _grads(fn, s, t, mask, lengths, nested=True)
        except Exception as e:  # a loss that cannot take nested input is exactly the finding
            problems.append(f"{name}: raised {type(e).__name__} on nested input: {e}")
            continue
        dv = float(torch.where(mask, (val_p - val_n).abs(), torch.zeros(())).max()) if mask.any() else 0.0
        mg = mask.view(*mask.shape, *([1] * (grad_p.dim() - 2)))
        dg = float(torch.where(mg, (grad_p - grad_n).abs(), torch.zeros(())).max()) if mask.any() else 0.0
        if dv > NESTED_ATOL or dg > NESTED_ATOL:
            problems.append(f"{name}: nested vs padded differ (values {dv:.3g}, grads {dg:.3g})")
        checked.append(name)
    lens = sorted(set(lengths.tolist()))
    return CheckResult("nested-matches-padded", backend, FAIL if problems else PASS,
                       "; ".join(problems) or f"{len(checked)} losses agree on nested and padded "
                       f"input (row lengths {lens[:6]}{'...' if len(lens) > 6 else ''})",
                       {"checked": checked})

