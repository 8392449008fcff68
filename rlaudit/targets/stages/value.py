"""Stage checks of ``value_loss``: a critic's clipped value loss and its normalisation across
micro-batches.

The reference is :func:`rlaudit.algo.value_loss.value_loss` (per token
``0.5 * max((v - G)^2, (clip(v, V - c, V + c) - G)^2)``) aggregated by
:func:`rlaudit.algo.agg.agg_loss` in the adapter's ``loss_agg_mode``; ``critic/vf_clipfrac`` is
the token-mean of "the clipped term was larger". Inputs come from the fixed cases: the old values
``V`` are the case's ``values``, the predictions ``v = V + (log_probs - old_log_probs)`` (the
cases' log-ratios, -1.2 .. 1.5, put tokens inside and on both sides of every clip window) and
the returns ``G = V + advantages``.

The split check is the one a trainer that normalises each micro-batch by its own token count
fails (verl before 0.9: ``workers/utils/losses.py`` called ``compute_value_loss`` without the
global counts, fixed by https://github.com/verl-project/verl/pull/6957).
"""

from __future__ import annotations

import torch

from rlaudit.algo.agg import AGG_MODES, Denominators, agg_loss
from rlaudit.algo.value_loss import value_loss as reference_value_loss
from rlaudit.targets.contract.adapter import accepts
from rlaudit.targets.contract.guard import AdapterRaised
from rlaudit.targets.inputs.cases import Case, split_rows
from rlaudit.targets.stages.common import grad_of
from rlaudit.targets.stages.registry import StageEnv, attempt, stage_check
from rlaudit.verdict.result import NA, CheckResult

#: half-widths of the clip window around the old values: a narrow one (most of the cases'
#: moves clipped) and PPO's common 0.5; neither is one of the cases' log-ratios, so no
#: prediction sits on the window's edge, where clamp (gradient 1) and a max/min clip (gradient
#: 1/2 at the tie) legitimately differ
CLIPRANGES = (0.15, 0.5)
CLIPFRAC = "critic/vf_clipfrac"


def value_inputs(case: Case) -> dict[str, torch.Tensor]:
    """``vpreds``, ``values``, ``returns`` of ``case`` (see the module docstring)."""
    values = case["values"]
    return {"vpreds": values + (case["log_probs"] - case["old_log_probs"]),
            "values": values, "returns": values + case["advantages"]}


def oracle_value_loss(case: Case, mode: str, cliprange: float,
                      denominators: Denominators | None = None):
    """The reference's (loss, gradient wrt vpreds, vf_clipfrac) on ``case``."""
    x = value_inputs(case)
    leaf = x["vpreds"].detach().clone().requires_grad_(True)
    loss_mat, clipped = reference_value_loss(leaf, x["values"], x["returns"], case.mask,
                                             cliprange_value=cliprange)
    loss = agg_loss(loss_mat, case.mask, mode, denominators)
    n = int(case.mask.sum())
    clipfrac = float(clipped.sum()) / n if n else 0.0
    return loss.detach(), grad_of(loss, leaf), clipfrac


def adapter_value_loss(env: StageEnv, case: Case, mode: str, cliprange: float,
                       denominators: Denominators | None = None, *, label: str = ""):
    """The adapter's (loss, metrics, gradient wrt vpreds) on ``case``."""
    x = value_inputs(case)
    kw = dict(vpreds=x["vpreds"].detach().clone().requires_grad_(True), values=x["values"],
              returns=x["returns"], response_mask=case.mask, cliprange_value=cliprange,
              loss_agg_mode=mode)
    if denominators is not None:
        kw["denominators"] = denominators
    out, given = env.call("value_loss", label=label, **kw)
    if not (isinstance(out, tuple) and len(out) == 2):
        raise AdapterRaised("value_loss", TypeError(
            f"expected (loss, metrics), got {type(out).__name__}"))
    loss, metrics = out
    return loss, dict(metrics or {}), grad_of(loss, given["vpreds"])


def _runs(env: StageEnv):
    """(label, loss_agg_mode, cliprange) for every mode the adapter implements."""
    for mode in env.names("loss_agg_modes", AGG_MODES, key="value"):
        for c in CLIPRANGES:
            yield f"{mode}, cliprange_value={c}", mode, c


@stage_check("value_loss", "parity", "parity")
def value_parity(env: StageEnv) -> CheckResult:
    """The loss, its gradient with respect to the predictions and ``critic/vf_clipfrac`` (when
    returned) equal the reference's for every ``loss_agg_mode`` and clip range on every case:
    an ignored clip window, a clip around the returns instead of the old values, a missing
    factor 1/2 or a wrong aggregation shows up here."""
    t = env.tally("value_loss:parity")
    seq_count = env.conventions(t.check).get("seq_count", "valid-rows")
    for label, mode, c in _runs(env):
        for case in env.cases:
            def one(label=label, mode=mode, c=c, case=case):
                loss, metrics, grad = adapter_value_loss(env, case, mode, c,
                                                         label=f"{label} on {case.name}")
                # the batch's own counts, N_seq as the adapter declares it
                own = (None if seq_count == "valid-rows"
                       else Denominators.of(case.mask, seq_count=seq_count))
                want, want_grad, clipfrac = oracle_value_loss(case, mode, c, own)
                t.compare(f"{label} on {case.name}", loss, want)
                t.compare(f"{label} gradient on {case.name}", grad, want_grad, case.mask)
                if CLIPFRAC in metrics and bool(case.mask.any()):
                    t.compare(f"{label} {CLIPFRAC} on {case.name}", metrics[CLIPFRAC], clipfrac)
            attempt(t, label, one, skip_as=mode)
    return t.result("mode x clip range x case comparisons agree")


@stage_check("value_loss", "global-split", "metamorphic")
def value_global_split(env: StageEnv) -> CheckResult:
    """With the whole batch's ``Denominators`` passed to each micro-batch, the micro-batch value
    losses and gradients sum to the adapter's own whole-batch values: the critic's loss is
    normalised over the mini-batch, not per micro-batch (a per-micro-batch token-mean weighs the
    tokens of short micro-batches up). n/a when ``value_loss`` takes no ``denominators``."""
    t = env.tally("value_loss:global-split")
    if not accepts(env.adapter.value_loss, "denominators"):
        return CheckResult(t.check, env.name, NA, "value_loss takes no `denominators` argument")
    seq_count = env.conventions(t.check).get("seq_count", "valid-rows")
    for label, mode, c in _runs(env):
        for case in env.cases:
            def one(label=label, mode=mode, c=c, case=case):
                denom = Denominators.of(case.mask, norm_len=case.shape[1], seq_count=seq_count)
                whole, _, w_grad = adapter_value_loss(env, case, mode, c, denom,
                                                      label=f"{label} whole batch")
                total, grad = 0.0, torch.zeros_like(w_grad)
                for rows in split_rows(len(case.mask)):
                    loss, _, g = adapter_value_loss(env, case.rows(rows), mode, c, denom,
                                                    label=f"{label} rows {rows.tolist()}")
                    total += float(loss.detach() if isinstance(loss, torch.Tensor) else loss)
                    grad[rows] = g
                t.compare(f"{label} on {case.name}: sum of micro-batch losses", total,
                          whole.detach() if isinstance(whole, torch.Tensor) else whole)
                t.compare(f"{label} on {case.name}: micro-batch gradients", grad, w_grad,
                          case.mask)
            attempt(t, label, one, skip_as=mode)
    return t.result("split sums agree with the whole-batch values")
