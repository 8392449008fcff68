"""Comparing two tensors elementwise within a tolerance: the check under every per-token,
parameter and stage comparison, naming the worst entries when one fails."""

from __future__ import annotations

import torch

from rlaudit.verdict.tolerance import Tolerance


def compare_tensors(name: str, got: torch.Tensor, want: torch.Tensor, tol: Tolerance,
                    mask: torch.Tensor | None = None, *, top: int = 3,
                    slack: torch.Tensor | float = 0.0) -> tuple[bool, str, dict]:
    """Elementwise |got - want| <= atol + rtol*|want| + slack where ``mask``; message names the
    worst (row, token) entries. ``got``, ``want``: any one shape (a shape mismatch fails);
    ``mask``: like ``want``, True where an entry is compared (None: every entry). ``slack`` (a
    scalar or a tensor like ``want``): a measured noise floor
    (rlaudit.verdict.compare.NOISE_FACTOR). A non-finite ``got`` where ``want`` is finite fails.
    Returns (ok, message, details: ``max_abs_diff`` over compared entries; on failure the
    ``top`` worst entries and ``missed_by``, how many times its bound the farthest one is off)."""
    got = got.double()
    want = want.double()
    if got.shape != want.shape:
        return False, f"{name}: shape {tuple(got.shape)} != {tuple(want.shape)}", {}
    # the passing case in few full-size operations (a model's parameters: 56 compares of 364k
    # entries in kl_k1); err > bound is err - bound > 0 for every pair of doubles
    err = (got - want).abs_()
    bound = want.abs().mul_(tol.rtol).add_(tol.atol).add_(slack)
    bad = err > bound
    # NaN/inf where the expectation is finite is a failure (NaN > bound is False)
    if not bool(torch.isfinite(got).all()):
        bad |= ~torch.isfinite(got) & torch.isfinite(want)
    if mask is not None:
        mask = mask.bool()
        bad &= mask
        err_in = torch.where(mask, err, torch.zeros_like(err))
    else:
        err_in = err
    worst_abs = float(err_in.max()) if got.numel() else 0.0
    details = {"max_abs_diff": worst_abs}
    if not bool(bad.any()):
        return True, f"{name}: max |diff| {worst_abs:.3g}", details
    # the worst first, among the entries out of tolerance only (an entry whose expectation is
    # NaN is never one); a non-finite entry counts as infinitely far out
    excess = (err - bound).nan_to_num(nan=float("inf"), posinf=float("inf"))
    flat = torch.where(bad, excess, -float("inf")).flatten()
    idx = torch.topk(flat, min(top, int(bad.sum()))).indices
    worst = []
    for i in idx.tolist():
        pos = list(torch.unravel_index(torch.tensor(i), got.shape))
        pos = [int(p) for p in pos]
        worst.append({"index": pos, "got": float(got.flatten()[i]), "want": float(want.flatten()[i])})
    details["worst"] = worst
    # how many times its bound the farthest entry is off (a near miss of a measured noise
    # floor is measured again: rlaudit/targets/run/runner.py); inf for a zero bound or non-finite
    ratio = torch.where(bad, err / bound, 0.0).nan_to_num(nan=float("inf"))
    details["missed_by"] = float(ratio.max())
    w = worst[0]
    floor = ""
    if isinstance(slack, torch.Tensor) or slack:
        floor = f", noise floor up to {float(torch.as_tensor(slack).max()):.2g}"
    return False, (f"{name}: {int(bad.sum())} entries out of tolerance (rtol={tol.rtol:g}, "
                   f"atol={tol.atol:g}{floor}); worst at {w['index']}: {w['got']:.6g} vs "
                   f"{w['want']:.6g}"), details
