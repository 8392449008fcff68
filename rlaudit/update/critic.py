"""The critic: value computation and the clipped value-loss update, written once for every backend.

Same cutting and reduction rules as the actor (rlaudit/update/actor.py): global mini-batches,
this rank's shard, micro-batches plus padding micro-batches, loss contributions divided by the
mini-batch's global denominators (``critic.loss_agg_mode``).
"""

from __future__ import annotations

from functools import partial

import torch

from rlaudit.algo.agg import Denominators, agg_loss
from rlaudit.algo.value_loss import value_loss
from rlaudit.config import Config
from rlaudit.data.batch import RolloutBatch
from rlaudit.update.actor import forward_rows, check_fields
from rlaudit.update.context import ForwardSpec, ParallelContext
from rlaudit.update.stats import LOCAL
from rlaudit.update.plan import optimizer_steps

VALUE_SPEC = ForwardSpec(kind="values")


def critic_loss(micro: RolloutBatch, out: dict, *, cfg: Config, denom: Denominators,
                stat_denom: Denominators | None = None
                ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """0.5 * max((v - R)^2, (clip(v, v_old +- c) - R)^2), aggregated with critic.loss_agg_mode;
    vf_clipfrac and vpred_mean are token-means over the mini-batch's valid tokens (local values
    over ``stat_denom`` too when given, as in :func:`rlaudit.update.actor.actor_loss`)."""
    mask = micro.mask
    vpreds = out["values"]
    loss_mat, clipped = value_loss(vpreds, micro["values"], micro["returns"], mask,
                                   cliprange_value=cfg.critic.cliprange_value)

    def reduce(d: Denominators, detach: bool) -> dict[str, torch.Tensor]:
        tok = partial(agg_loss, mask=mask, mode="token-mean", denom=d)
        return {"critic/vf_loss": agg_loss(loss_mat.detach() if detach else loss_mat, mask,
                                           cfg.critic.loss_agg_mode, d),
                "critic/vf_clipfrac": tok(clipped.to(vpreds.dtype)),
                "critic/vpred_mean": tok(vpreds.detach())}

    stats = reduce(denom, detach=False)
    if stat_denom is not None:
        stats.update({f"{k}{LOCAL}": v for k, v in reduce(stat_denom, detach=True).items()})
    return stats["critic/vf_loss"], stats


def compute_values(ctx: ParallelContext, batch: RolloutBatch, cfg: Config) -> torch.Tensor:
    """Forward-only values [B, R] of every row, gathered from all ranks (0 past each response)."""
    (values,) = forward_rows(ctx, batch, cfg, VALUE_SPEC, ("values",))
    return values


def update_critic(ctx: ParallelContext, batch: RolloutBatch, cfg: Config) -> dict[str, float]:
    """One critic update: ``critic.ppo_epochs`` x mini-batches (``actor.ppo_mini_batch_size *
    rollout.n`` rows, as in verl), each one optimizer step."""
    crit = cfg.critic
    check_fields(batch, ["values", "returns"], "the critic update")
    return optimizer_steps(ctx, batch, cfg, role="critic", epochs=crit.ppo_epochs,
                           micro_batch_size=crit.ppo_micro_batch_size_per_gpu, spec=VALUE_SPEC,
                           loss=critic_loss, grad_clip=crit.grad_clip)
