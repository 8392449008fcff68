"""Stage checks of ``policy_loss`` and ``distill_loss``.

Policy loss is compared with :meth:`ReferenceAdapter.policy_loss` (rlaudit.algo's formulas) for
every loss mode x aggregation mode x clip setting; the clip settings are asymmetric and the
inputs' log-ratios hit every clip region (cases.LOG_RATIOS), so an ignored ``clip_ratio_high``,
a missing dual clip or a wrong aggregation shows up as a value, gradient or metric mismatch.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from rlaudit.algo.agg import AGG_MODES, Denominators
from rlaudit.algo.distill import DISTILL_LOSSES
from rlaudit.algo.policy_loss import POLICY_LOSSES
from rlaudit.scenarios.invariants.loss_layouts import check_nested_losses, distill_inputs
from rlaudit.targets.contract.adapter import accepts
from rlaudit.targets.contract.guard import AdapterRaised
from rlaudit.targets.contract.own_adapters import ReferenceAdapter
from rlaudit.targets.inputs.cases import Case, fixed_permutation, split_rows, with_garbage
from rlaudit.targets.stages.common import grad_of
from rlaudit.targets.stages.registry import StageEnv, attempt, stage_check
from rlaudit.verdict.result import NA, CheckResult
from rlaudit.verdict.tolerance import Tolerance

#: (clip_ratio_low, clip_ratio_high, clip_ratio_c): DAPO's asymmetric clip-higher, and another
#: asymmetric setting with a tighter dual clip
CLIP_SETTINGS = ((0.2, 0.28, 3.0), (0.1, 0.3, 2.0))
#: metrics compared with the reference when the adapter returns them
POLICY_METRICS = ("actor/pg_loss", "actor/pg_clipfrac", "actor/pg_clipfrac_lower",
                  "actor/ppo_kl")

_ORACLE = ReferenceAdapter()


def _policy_kwargs(case: Case, loss_mode: str, agg: str, clip) -> dict:
    low, high, c = clip
    return dict(old_log_prob=case["old_log_probs"],
                log_prob=case["log_probs"].clone().requires_grad_(True),
                advantages=case["advantages"], response_mask=case.mask, loss_mode=loss_mode,
                loss_agg_mode=agg, clip_ratio_low=low, clip_ratio_high=high, clip_ratio_c=c)


def adapter_policy(env: StageEnv, case: Case, loss_mode: str, agg: str, clip,
                    denominators=None, label=""):
    """(loss, metrics, grad of loss w.r.t. log_prob) from the adapter."""
    kw = _policy_kwargs(case, loss_mode, agg, clip)
    if denominators is not None:
        kw["denominators"] = denominators
    out, given = env.call("policy_loss", label=label or f"{loss_mode}/{agg} on {case.name}", **kw)
    if not (isinstance(out, (tuple, list)) and len(out) == 2 and isinstance(out[1], dict)):
        raise AdapterRaised("policy_loss", TypeError(
            f"expected (loss, metrics dict), got {type(out).__name__}"))
    loss, metrics = out
    return loss, metrics, grad_of(loss, given["log_prob"])


def _floats(metrics: dict) -> dict:
    return {k: float(v.detach() if isinstance(v, torch.Tensor) else v) for k, v in metrics.items()}


def oracle_policy(case: Case, loss_mode: str, agg: str, clip, denominators=None,
                   conventions=None):
    """(loss, metrics, gradient) of the reference; under the declared ``conventions`` (a
    ``seq_count`` of "all-rows" counts every row in N_seq; ``gspo_gradient``)."""
    conventions = conventions or {}
    kw = _policy_kwargs(case, loss_mode, agg, clip)
    if denominators is None and conventions.get("seq_count", "valid-rows") != "valid-rows":
        denominators = Denominators.of(case.mask, norm_len=case.shape[1],
                                       seq_count=conventions["seq_count"])
    loss, metrics = _ORACLE.policy_loss(**kw, denominators=denominators,
                                        gspo_gradient=conventions.get("gspo_gradient",
                                                                      "per-token"))
    return loss.detach(), metrics, grad_of(loss, kw["log_prob"])


def _policy_runs(env: StageEnv, *, first_clip_only: bool = False):
    clips = env.setting("clip_settings", CLIP_SETTINGS)
    clips = clips[:1] if first_clip_only else clips
    for mode in env.names("loss_modes", POLICY_LOSSES):
        for agg in env.names("loss_agg_modes", AGG_MODES, key=mode):
            for clip in clips:
                yield f"{mode}/{agg} clip={clip}", mode, agg, clip


@stage_check("policy_loss", "parity", "parity")
def policy_parity(env: StageEnv) -> CheckResult:
    """Loss, its gradient with respect to ``log_prob`` (0 on masked tokens) and the returned
    metrics (``actor/pg_clipfrac``, ``actor/pg_clipfrac_lower``, ``actor/ppo_kl``,
    ``actor/pg_loss``, when present) equal the reference's for every loss mode, aggregation mode
    and asymmetric clip setting (``clip_ratio_high != clip_ratio_low``)."""
    t = env.tally("policy_loss:parity")
    for label, mode, agg, clip in _policy_runs(env):
        for case in env.cases:
            def one():
                loss, metrics, grad = adapter_policy(env, case, mode, agg, clip)
                w_loss, w_metrics, w_grad = oracle_policy(case, mode, agg, clip,
                                                           conventions=env.conventions(t.check))
                near = _near_clip(case, clip, t.tol)
                t.compare(f"{label} loss on {case.name}", loss, w_loss)
                # a token on a clip bound (within rounding) may be clipped or not: its gradient
                # is 0 or not, either correctly
                t.compare(f"{label} gradient on {case.name}", grad, w_grad,
                          mask=~near if bool(near.any()) else None)
                share = float(near.sum()) / max(int(case.mask.sum()), 1)
                for name in POLICY_METRICS:
                    if name in metrics:
                        tol = None
                        if name in CLIP_FRACTIONS:
                            tol = Tolerance(t.tol.rtol, t.tol.atol + share)
                        t.compare(f"{label} {name} on {case.name}", metrics[name],
                                  w_metrics[name], tol=tol)
            attempt(t, label, one, skip_as=mode)
    return t.result("loss/gradient/metric comparisons agree")


#: metrics that count tokens on one side of a clip bound (a fraction of the valid tokens)
CLIP_FRACTIONS = ("actor/pg_clipfrac", "actor/pg_clipfrac_lower")


def _near_clip(case: Case, clip, tol: Tolerance) -> torch.Tensor:
    """``[B, R]`` bool: valid tokens whose importance ratio (per token, or its row's geometric
    mean, as GSPO takes it) lies within the declared precision's rounding of a clip bound. Each
    may land on either side in a correct trainer: clipped or not, its gradient 0 or not, counted
    in a clip fraction or not. None in float64 unless a ratio sits on a bound."""
    mask = case.mask.bool()
    lp, old = case["log_probs"].double(), case["old_log_probs"].double()
    log_ratio = torch.where(mask, lp - old, 0.0)
    # how far rounding can move a log-ratio: relative to the log-probs it is taken from
    room = tol.rtol * (lp.abs() + old.abs()) + tol.atol
    per_row = log_ratio.sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1)
    near = torch.zeros_like(mask)
    for bound in (1.0 - clip[0], 1.0 + clip[1], clip[2]):
        if bound <= 0:
            continue
        b = torch.log(torch.tensor(float(bound), dtype=torch.float64))
        near |= (log_ratio - b).abs() <= room
        near |= ((per_row - b).abs() <= room.max()).expand_as(mask)
    return near & mask


@stage_check("policy_loss", "global-split", "metamorphic")
def policy_global_split(env: StageEnv) -> CheckResult:
    """With the whole batch's ``Denominators`` passed to each micro-batch, the micro-batch losses
    and gradients sum to the adapter's own whole-batch values (global normalisation; a
    per-micro-batch token-mean fails this), and so do the metrics — or, for an adapter that
    declares ``metric_reduction = "microbatch-mean"``, each micro-batch's metrics equal the
    reference's metrics of that micro-batch alone (its local means). n/a when ``policy_loss``
    takes no ``denominators``."""
    t = env.tally("policy_loss:global-split")
    if not accepts(env.adapter.policy_loss, "denominators"):
        return CheckResult(t.check, env.name, NA, "policy_loss takes no `denominators` argument")
    local = {n for n in POLICY_METRICS if env.decl.metric_mode(n) == "microbatch-mean"}
    for label, mode, agg, clip in _policy_runs(env, first_clip_only=True):
        for case in env.cases:
            def one():
                denom = Denominators.of(case.mask, norm_len=case.shape[1],
                                        seq_count=env.conventions(t.check).get(
                                            "seq_count", "valid-rows"))
                w_loss, w_metrics, w_grad = adapter_policy(env, case, mode, agg, clip,
                                                            label=f"{label} whole batch")
                w_metrics = _floats(w_metrics)      # values as returned (before later calls)
                total, grad, sums = 0.0, torch.zeros_like(w_grad), {}
                for rows in split_rows(len(case.mask)):
                    part = case.rows(rows)
                    loss, metrics, g = adapter_policy(env, part, mode, agg, clip,
                                                       denom, label=f"{label} rows {rows.tolist()}")
                    total += float(loss.detach() if isinstance(loss, torch.Tensor) else loss)
                    grad[rows] = g
                    if local:   # these metrics: each micro-batch reports its own local means
                        _, want, _ = oracle_policy(part, mode, agg, clip,
                                                    conventions=env.conventions(t.check))
                        for name in local & set(metrics):
                            if bool(part.mask.any()):
                                t.compare(f"{label} on {part.name}: micro-batch {name} (its "
                                          f"local mean)", metrics[name], want[name])
                    for name in POLICY_METRICS:
                        if name in metrics and name not in local:
                            sums[name] = sums.get(name, 0.0) + float(metrics[name])
                t.compare(f"{label} on {case.name}: sum of micro-batch losses", total,
                          w_loss.detach() if isinstance(w_loss, torch.Tensor) else w_loss)
                t.compare(f"{label} on {case.name}: micro-batch gradients", grad, w_grad)
                for name, value in sums.items():
                    if name in w_metrics and name not in local:
                        t.compare(f"{label} on {case.name}: sum of micro-batch {name}", value,
                                  w_metrics[name])
            attempt(t, label, one, skip_as=mode)
    return t.result("split sums agree with the whole-batch values")


@stage_check("policy_loss", "row-permutation", "metamorphic")
def policy_permutation(env: StageEnv) -> CheckResult:
    """Permuting rows leaves the loss unchanged and permutes its gradient the same way."""
    t = env.tally("policy_loss:row-permutation")
    for label, mode, agg, clip in _policy_runs(env, first_clip_only=True):
        for case in env.cases:
            if len(case.mask) < 2:
                continue
            perm = fixed_permutation(len(case.mask))

            def one():
                loss, _, grad = adapter_policy(env, case, mode, agg, clip)
                loss_p, _, grad_p = adapter_policy(env, case.permuted(perm), mode, agg, clip)
                t.compare(f"{label} loss on {case.name} (rows permuted)", loss_p, loss.detach())
                t.compare(f"{label} gradient on {case.name} (rows permuted)", grad_p, grad[perm])
            attempt(t, label, one, skip_as=mode)
    return t.result("permuted runs agree")


@stage_check("policy_loss", "masked-values", "metamorphic")
def policy_masked(env: StageEnv) -> CheckResult:
    """Log-probs and advantages written where ``response_mask`` is False (finite garbage) change
    neither the loss, nor the metrics, nor the gradient; the gradient on masked tokens is 0."""
    t = env.tally("policy_loss:masked-values")
    for label, mode, agg, clip in _policy_runs(env, first_clip_only=True):
        for case in env.cases:
            def one():
                loss, metrics, grad = adapter_policy(env, case, mode, agg, clip)
                metrics = _floats(metrics)
                loss_g, metrics_g, grad_g = adapter_policy(env, with_garbage(case), mode, agg,
                                                            clip)
                t.compare(f"{label} loss on {case.name} with garbage under the mask", loss_g,
                          loss.detach())
                t.compare(f"{label} gradient on {case.name} with garbage under the mask",
                          grad_g, grad)
                for name in POLICY_METRICS:
                    if name in metrics and name in metrics_g:
                        t.compare(f"{label} {name} on {case.name} with garbage under the mask",
                                  metrics_g[name], metrics[name])
            attempt(t, label, one, skip_as=mode)
    return t.result("runs with garbage under the mask agree")


@stage_check("policy_loss", "metrics-are-copies", "no-mutation")
def policy_metrics_copies(env: StageEnv) -> CheckResult:
    """The loss and metrics a call returned keep their values when the adapter is called again
    on other inputs (a metric returned as a view of a buffer the adapter reuses changes later)."""
    t = env.tally("policy_loss:metrics-are-copies")
    first, second = env.cases[0], env.cases[1 % len(env.cases)]
    for label, mode, agg, clip in _policy_runs(env, first_clip_only=True):
        def one():
            loss, metrics, _ = adapter_policy(env, first, mode, agg, clip)
            kept = {"loss": loss, **metrics}
            values = {k: float(v.detach() if isinstance(v, torch.Tensor) else v)
                      for k, v in kept.items()}
            adapter_policy(env, second if second is not first else with_garbage(first), mode,
                            agg, clip)
            for k, v in kept.items():
                t.compare(f"{label} {k} returned by the first call, after a second call",
                          v.detach() if isinstance(v, torch.Tensor) else v, values[k])
        attempt(t, label, one, skip_as=mode)
    return t.result("returned values unchanged by later calls")


# ---- distillation ----------------------------------------------------------------------------

def _distill_case(env: StageEnv):
    """Lengths/width of the first case (0-, 1- and full-length rows) and the padded inputs."""
    case = env.cases[0]
    lengths = case["response_lengths"]
    width = case.shape[1]
    mask = torch.arange(width).unsqueeze(0) < lengths.unsqueeze(1)
    return lengths, width, mask, distill_inputs(lengths, width)


@stage_check("distill_loss", "parity", "parity")
def distill_parity(env: StageEnv) -> CheckResult:
    """Padded-input distillation losses (per-token values and gradients with respect to the
    student's log-probs) equal the reference's on valid tokens."""
    t = env.tally("distill_loss:parity")
    lengths, width, mask, (s_k, t_k, s_1, t_1) = _distill_case(env)
    for name in env.names("distill_losses", DISTILL_LOSSES):
        s, teacher = (s_k, t_k) if name == "forward_kl_topk" else (s_1, t_1)

        def one(name=name, s=s, teacher=teacher):
            out, given = env.call("distill_loss", label=name, name=name,
                                  student=s.clone().requires_grad_(True), teacher=teacher,
                                  mask=mask)
            leaf = s.clone().requires_grad_(True)
            want = _ORACLE.distill_loss(name=name, student=leaf, teacher=teacher, mask=mask)
            t.compare(f"{name} values", out, want.detach(), mask)
            if isinstance(out, torch.Tensor) and out.shape == mask.shape:
                t.compare(f"{name} gradient", grad_of(out, given["student"], mask),
                          grad_of(want, leaf, mask))
        attempt(t, name, one)
    return t.result("distillation losses agree with the reference")


@stage_check("distill_loss", "nested-matches-padded", "seed")
def distill_nested(env: StageEnv) -> CheckResult:
    """The same per-token inputs as ``torch.nested`` jagged tensors (mask None) and as padded
    tensors with a mask give the same per-token losses and gradients, for rows of length 0, 1 and
    the full width (verl PR #5997: index operations failed on nested tensors)."""
    lengths, width, mask, _ = _distill_case(env)
    names = env.names("distill_losses", DISTILL_LOSSES)
    losses = {f"distill:{n}": (lambda s, t, m, n=n: env.adapter.distill_loss(
        name=n, student=s, teacher=t, mask=m), n == "forward_kl_topk") for n in names}
    view = SimpleNamespace(batch=_LengthsView(lengths, width))
    res = check_nested_losses(view, env.name, losses)
    res.invariant = "distill_loss:nested-matches-padded"
    return res


class _LengthsView:
    """What check_nested_losses reads of a batch: response_lengths and the width R."""

    def __init__(self, lengths: torch.Tensor, width: int):
        self._lengths, self.response_width = lengths, width

    def __getitem__(self, key: str) -> torch.Tensor:
        if key != "response_lengths":
            raise KeyError(key)
        return self._lengths
