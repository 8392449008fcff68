"""Stage checks of ``agg_loss``: every loss_agg_mode against rlaudit.algo.agg (value and
gradient), and the global-normalisation split (micro-batch contributions with the whole batch's
denominators sum to the whole-batch value). ``loss_mat`` and ``mask`` are ``[B, R]``.
"""

from __future__ import annotations

import torch

from rlaudit.algo.agg import AGG_MODES, Denominators, agg_loss
from rlaudit.targets.contract.adapter import accepts
from rlaudit.targets.inputs.cases import Case, split_rows
from rlaudit.targets.stages.common import grad_of
from rlaudit.targets.stages.registry import StageEnv, attempt, stage_check
from rlaudit.verdict.result import NA, CheckResult


# ---- loss aggregation ------------------------------------------------------------------------

def _agg(env: StageEnv, loss_mat, mask, mode, denominators=None, label=""):
    kw = dict(loss_mat=loss_mat, mask=mask, mode=mode)
    if denominators is not None:
        kw["denominators"] = denominators
    out, given = env.call("agg_loss", label=label, **kw)
    return out, given["loss_mat"]


def _own_counts(env: StageEnv, check: str, mask: torch.Tensor, norm_len=None
                ) -> Denominators | None:
    """The counts a batch's own aggregation divides by, under the declared ``seq_count``
    convention (None: the reference's default, rows with a valid token)."""
    seq_count = env.conventions(check).get("seq_count", "valid-rows")
    if seq_count == "valid-rows" and norm_len is None:
        return None
    return Denominators.of(mask, norm_len=norm_len, seq_count=seq_count)


def _loss_input(case: Case) -> torch.Tensor:
    return (case["log_probs"] - case["old_log_probs"]) * case["advantages"]


@stage_check("agg_loss", "parity", "parity")
def agg_parity(env: StageEnv) -> CheckResult:
    """Every ``loss_agg_mode`` gives the reference's value and gradient (docs/internals.md table;
    ``seq-mean-token-sum-norm`` divides by the width R), and a batch without any valid token
    gives 0, not NaN."""
    t = env.tally("agg_loss:parity")
    for mode in env.names("loss_agg_modes", AGG_MODES):
        for case in env.cases:
            def one(mode=mode, case=case):
                lm = _loss_input(case).requires_grad_(True)
                out, leaf = _agg(env, lm, case.mask, mode, label=f"{mode} on {case.name}")
                ref_leaf = lm.detach().clone().requires_grad_(True)
                want = agg_loss(ref_leaf, case.mask, mode, _own_counts(env, t.check, case.mask))
                t.compare(f"{mode} on {case.name}", out, want.detach())
                t.compare(f"{mode} gradient on {case.name}", grad_of(out, leaf),
                          grad_of(want, ref_leaf), case.mask)
                empty = ~case.mask.any(-1)
                if bool(empty.any()):
                    rows = empty.nonzero().flatten()
                    e_out, _ = _agg(env, lm.detach()[rows], case.mask[rows], mode,
                                    label=f"{mode} on rows without a valid token")
                    t.compare(f"{mode} on rows of {case.name} without a valid token", e_out,
                              torch.zeros((), dtype=torch.float64))
            attempt(t, mode, one)
    return t.result("mode x case comparisons agree")


def trimmed_width(mask: torch.Tensor) -> int:
    """The width of ``mask``'s rows cut after the last column holding a valid token (1 when
    none does): a micro-batch padded to its own longest response."""
    cols = mask.any(0).nonzero()
    return int(cols[-1]) + 1 if len(cols) else 1


def width_note(widths: list[int], norm_len: float) -> str:
    """What a failure's message adds when micro-batches are narrower than the whole batch's
    ``norm_len`` (the width R the loss is normalised by, passed in ``denominators``): a
    seq-mean-token-sum-norm that divides by a micro-batch's own width fails exactly there."""
    other = [w for w in widths if w != norm_len]
    if not other:
        return ""
    return (f" (micro-batch widths {widths} differ from the norm_len {norm_len:g} the loss is "
            f"normalised by: a micro-batch's own width is not the divisor)")


@stage_check("agg_loss", "global-split", "metamorphic")
def agg_global_split(env: StageEnv) -> CheckResult:
    """With the whole batch's ``Denominators`` passed to every micro-batch, the micro-batch
    results (and gradients) sum to the adapter's own whole-batch value: the loss is normalised
    globally, never per micro-batch (a token-mean per micro-batch then averaged weighs short
    micro-batches up). n/a when ``agg_loss`` takes no ``denominators``."""
    t = env.tally("agg_loss:global-split")
    if not accepts(env.adapter.agg_loss, "denominators"):
        return CheckResult(t.check, env.name, NA, "agg_loss takes no `denominators` argument")
    for mode in env.names("loss_agg_modes", AGG_MODES):
        for case in env.cases:
            def one(mode=mode, case=case):
                lm = _loss_input(case)
                denom = _own_counts(env, t.check, case.mask, norm_len=case.shape[1])
                leaf = lm.clone().requires_grad_(True)
                whole, whole_leaf = _agg(env, leaf, case.mask, mode, label=f"{mode} whole batch")
                whole_grad = grad_of(whole, whole_leaf)
                parts, grads, widths = [], torch.zeros_like(lm), []
                for rows in split_rows(len(lm)):
                    # each micro-batch padded to its own longest response, as trainers that
                    # pad per micro-batch do: the whole batch's width R reaches it only as
                    # denominators.norm_len (seq-mean-token-sum-norm divides by it)
                    w = trimmed_width(case.mask[rows])
                    widths.append(w)
                    leaf = lm[rows][:, :w].requires_grad_(True)
                    out, given_leaf = _agg(env, leaf, case.mask[rows][:, :w], mode, denom,
                                           label=f"{mode} rows {rows.tolist()} (width {w})")
                    parts.append(out.detach() if isinstance(out, torch.Tensor) else out)
                    grads[rows, :w] = grad_of(out, given_leaf)
                total = sum(float(p) for p in parts)
                why = width_note(widths, denom.norm_len)
                t.compare(f"{mode} on {case.name}: sum over {len(parts)} micro-batches{why}",
                          total, whole.detach())
                t.compare(f"{mode} gradient on {case.name}: sum over micro-batches{why}", grads,
                          whole_grad, case.mask)
            attempt(t, mode, one)
    return t.result("split sums agree with the whole-batch value")
