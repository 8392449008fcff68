"""The actor: log-prob computation and the policy update, written once for every backend.

``actor_loss`` assembles the loss of one micro-batch from the config (policy loss, entropy bonus,
KL loss, rollout-KL loss, distillation) as a *contribution* divided by the global denominators of
the mini-batch; contributions sum over micro-batches and data-parallel ranks to the loss of the
whole mini-batch, which is what one process would compute on it (so micro-batch size, token
budget, padding micro-batches and DP size cannot change the result).

Entropy (docs/findings.md, seeds): computed when ``calculate_entropy`` or ``entropy_coeff != 0``; whenever
computed it is reported as ``actor/entropy``; it enters the loss only when ``entropy_coeff != 0``.
"""

from __future__ import annotations

from functools import partial

import torch

from rlaudit.algo.agg import Denominators, agg_loss
from rlaudit.algo.distill import DISTILL_LOSSES
from rlaudit.algo.kl import kl_penalty
from rlaudit.algo.policy_loss import compute_policy_loss, importance_ratio
from rlaudit.algo.rollout_corr import rollout_kl_loss_mat
from rlaudit.config import Config
from rlaudit.data.batch import RolloutBatch
from rlaudit.errors import InputError
from rlaudit.metrics import CLIP_UNDECIDED, CLIP_UNDECIDED_ATOL, CLIP_UNDECIDED_RTOL
from rlaudit.update import forward_memo
from rlaudit.update.context import ForwardSpec, ParallelContext
from rlaudit.update.plan import optimizer_steps, plan_micro, rank_shard
from rlaudit.update.stats import LOCAL


def required_actor_fields(cfg: Config) -> list[str]:
    """Fields the actor update reads, so a missing one fails before any forward pass (SkyRL PR
    #1811: a missing rollout_log_probs raised inside the distributed backward)."""
    act = cfg.actor
    need = ["old_log_probs", "advantages"]
    if act.use_kl_loss:
        need.append("ref_log_probs")
    if act.rollout_correction.use_rollout_kl_loss:
        need.append("rollout_log_probs")
    if act.rollout_correction.rollout_is is not None:
        need.append("rollout_is_weights")
    if act.distill.enable:
        need += (["teacher_topk_ids", "teacher_topk_log_probs"]
                 if act.distill.loss_type == "forward_kl_topk" else ["teacher_log_probs"])
    return need


def check_fields(batch: RolloutBatch, need: list[str], what: str) -> None:
    missing = [f for f in need if f not in batch]
    if missing:
        raise InputError(f"{what} needs field(s) {missing} that the batch does not have "
                         f"(it has: {sorted(batch.keys())})", key=missing[0])


def actor_forward_spec(cfg: Config, *, for_update: bool) -> ForwardSpec:
    topk = ("teacher_topk_ids" if for_update and cfg.actor.distill.enable
            and cfg.actor.distill.loss_type == "forward_kl_topk" else None)
    return ForwardSpec(kind="logprobs", temperature=cfg.rollout.temperature,
                       calc_entropy=cfg.compute_entropy, chunk_size=cfg.actor.logprob_chunk_size,
                       topk_field=topk)


def actor_loss(micro: RolloutBatch, out: dict, *, cfg: Config, denom: Denominators,
               stat_denom: Denominators | None = None
               ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Loss contribution of one micro-batch and its metric contributions (catalogue names).

    Denominators: pg/entropy/KL terms use ``actor.loss_agg_mode`` with the mini-batch's global
    ``denom``; clip fractions and ppo_kl are token-means over the mini-batch's valid tokens.
    With ``stat_denom`` (the micro-batch's own counts) every metric is also reported over it,
    under ``<name>@local`` (rlaudit.update.stats.LOCAL): its local value, for metrics reduced
    as micro-batch means (``trainer.metric_reduction``). The loss never uses it.
    """
    act = cfg.actor
    mask = micro.mask
    logp = out["log_probs"]
    low = act.clip_ratio if act.clip_ratio_low is None else act.clip_ratio_low
    high = act.clip_ratio if act.clip_ratio_high is None else act.clip_ratio_high
    pol = compute_policy_loss(act.loss_mode, old_log_prob=micro["old_log_probs"], log_prob=logp,
                              advantages=micro["advantages"], mask=mask, clip_ratio_low=low,
                              clip_ratio_high=high, clip_ratio_c=act.clip_ratio_c,
                              gspo_gradient=act.gspo_gradient)
    loss_mat = pol.loss_mat
    # the ratios at which a clip flag flips (the dual clip's c: vanilla only)
    bounds = (1.0 - low, 1.0 + high) + ((act.clip_ratio_c,) if act.loss_mode == "vanilla"
                                        else ())
    if act.rollout_correction.rollout_is is not None:
        loss_mat = loss_mat * micro["rollout_is_weights"]
    # (metric name, per-token matrix, coefficient in the loss or None) of every loss term
    terms = [("actor/pg_loss", loss_mat, 1.0)]
    if cfg.compute_entropy:
        terms.append(("actor/entropy", out["entropy"],
                      -act.entropy_coeff if act.entropy_coeff != 0 else None))
    if act.use_kl_loss:
        ref = torch.where(mask, micro["ref_log_probs"], logp.detach())  # no NaN/inf from padding
        kl = kl_penalty(logp, ref, act.kl_loss_type, k3_clamp=cfg.algorithm.k3_clamp)
        if act.kl_loss_weight == "ratio":
            kl = kl * importance_ratio(logp, micro["old_log_probs"], mask,
                                       sequence=act.loss_mode == "gspo")
        terms.append(("actor/kl_loss", kl, act.kl_loss_coef))
    rc = act.rollout_correction
    if rc.use_rollout_kl_loss:
        terms.append(("actor/rollout_kl", rollout_kl_loss_mat(
            logp, micro["rollout_log_probs"], rc.rollout_kl_loss_type, mask=mask,
            k3_clamp=cfg.algorithm.k3_clamp),
            rc.rollout_kl_loss_coef))
    if act.distill.enable:
        fn = DISTILL_LOSSES.get(act.distill.loss_type)
        if act.distill.loss_type == "forward_kl_topk":
            mat = fn(out["topk_log_probs"], micro["teacher_topk_log_probs"], mask)
        else:
            mat = fn(logp, micro["teacher_log_probs"], mask)
        terms.append(("actor/distill_loss", mat, act.distill.coef))

    def reduce(d: Denominators, detach: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """(loss, metrics) of every term aggregated over counts ``d``."""
        stats, loss = {}, None
        for name, mat, coef in terms:
            value = agg_loss(mat.detach() if detach else mat, mask, act.loss_agg_mode, d)
            stats[name] = value
            if coef is not None:
                loss = coef * value if loss is None else loss + coef * value
        tok = partial(agg_loss, mask=mask, mode="token-mean", denom=d)
        stats["actor/pg_clipfrac"] = tok(pol.clipped.to(logp.dtype))
        stats["actor/pg_clipfrac_lower"] = tok(pol.clipped_lower.to(logp.dtype))
        stats["actor/ppo_kl"] = tok(pol.ppo_kl_mat)
        stats[CLIP_UNDECIDED] = tok(undecided_clips(
            pol.ratio, micro["advantages"], mask, band=bounds[:2], bounds=bounds).to(logp.dtype))
        stats["actor/loss"] = loss
        return loss, stats

    loss, stats = reduce(denom, detach=False)
    if stat_denom is not None:
        _, local = reduce(stat_denom, detach=True)
        stats.update({f"{k}{LOCAL}": v for k, v in local.items()})
    return loss, stats


def undecided_clips(ratio: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, *,
                    band: tuple[float, float], bounds: tuple[float, ...]) -> torch.Tensor:
    """``[B, R]`` bool: valid tokens whose clip flags rounding decides -- a ``ratio`` within
    CLIP_UNDECIDED_RTOL (relative) of one of the clip ``bounds``, or, outside the clip ``band``
    ``(1 - low, 1 + high)`` where the sign of the advantage picks the clipped term, a nonzero
    advantage within CLIP_UNDECIDED_ATOL of 0 (an advantage exactly 0 is 0 at any precision)."""
    ratio, adv = ratio.detach(), advantages.detach()
    near = torch.zeros_like(mask, dtype=torch.bool)
    for b in bounds:
        near |= (ratio - b).abs() <= CLIP_UNDECIDED_RTOL * b
    outside = (ratio < band[0]) | (ratio > band[1])
    near |= outside & (adv != 0) & (adv.abs() <= CLIP_UNDECIDED_ATOL)
    return near & mask.bool()


def compute_log_probs(ctx: ParallelContext, batch: RolloutBatch, cfg: Config, *,
                      calc_entropy: bool | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Forward-only log-probs (and entropy) of every row of ``batch``: [B, R] each, gathered from
    all data-parallel ranks, 0 where the token does not exist."""
    spec = actor_forward_spec(cfg, for_update=False)
    if calc_entropy is not None:
        spec = ForwardSpec(kind=spec.kind, temperature=spec.temperature, calc_entropy=calc_entropy,
                           chunk_size=spec.chunk_size)
    return forward_rows(ctx, batch, cfg, spec, ("log_probs", "entropy"))


def forward_rows(ctx, batch, cfg, spec, keys):
    """Run a no-grad forward over the whole batch split across ranks; reassemble rows in order.
    Inside a backend's replay on the CPU, a pass whose every input repeats an earlier one's is
    answered from the request's memo (rlaudit/update/forward_memo.py)."""
    plan = (cfg.actor.ppo_micro_batch_size_per_gpu, cfg.actor.use_dynamic_bsz,
            cfg.actor.ppo_max_token_len_per_gpu)
    return forward_memo.forward_rows(ctx, batch, spec, keys, plan,
                                     lambda: _forward_rows_now(ctx, batch, spec, keys, plan))


def _forward_rows_now(ctx, batch, spec, keys, plan):
    micro_batch_size, use_dynamic_bsz, max_token_len = plan
    idx = torch.arange(len(batch))
    rows = batch.with_fields(kinds={"_row": "seq"}, _row=idx)
    shard = rank_shard(ctx, rows, balance=False)
    plan = plan_micro(ctx, shard, micro_batch_size=micro_batch_size,
                      use_dynamic_bsz=use_dynamic_bsz, max_token_len=max_token_len,
                      norm_len=float(batch.response_width))
    # every rank runs every micro-batch, padding ones included: a sharded model's forward is a
    # collective (FSDP all-gathers parameters), so skipping passes on one rank desynchronises all
    results = ctx.forward_backward(plan.micros, spec, None)[: plan.num_real]
    out = []
    for key in keys:
        parts = [r["outputs"][key] for r in results if key in r["outputs"]]
        if not parts:
            out.append(None)
            continue
        local = torch.cat(parts, 0) if parts else None
        local_rows = torch.cat([m["_row"] for m in plan.micros[: plan.num_real]], 0)
        gathered = ctx.all_gather_rows(local)
        gathered_rows = ctx.all_gather_rows(local_rows.to(local.device))
        full = torch.zeros((len(batch), *local.shape[1:]), dtype=local.dtype)
        full[torch.cat(gathered_rows).cpu()] = torch.cat(gathered).cpu()
        out.append(full)
    return tuple(out)


def update_actor(ctx: ParallelContext, batch: RolloutBatch, cfg: Config) -> dict[str, float]:
    """One actor update on ``batch`` (every rank passes the same whole batch): ``ppo_epochs`` x
    mini-batches of ``ppo_mini_batch_size * rollout.n`` rows, each one optimizer step.

    Returns metrics (catalogue names): loss terms are per-mini-batch global values averaged over
    the optimizer steps; grad_norm is the pre-clip norm averaged over optimizer steps."""
    act = cfg.actor
    check_fields(batch, required_actor_fields(cfg), "the actor update")

    def extra(plan) -> dict:
        out = {"actor/num_microbatches": float(len(plan.micros))}
        if act.use_kl_loss:
            out["actor/kl_coef"] = act.kl_loss_coef
        return out

    return optimizer_steps(ctx, batch, cfg, role="actor", epochs=act.ppo_epochs,
                           micro_batch_size=act.ppo_micro_batch_size_per_gpu,
                           spec=actor_forward_spec(cfg, for_update=True), loss=actor_loss,
                           grad_clip=act.grad_clip, extra=extra, cp=act.context_parallel_size)
