"""What no peer's own training step maps (verl, SkyRL, slime, AReaL): the layout settings of
rlaudit's config that change which rows a step sees or how they are cut, each named as the
n/a reason a peer's ``supports()`` gives. Peer-specific refusals stay with each peer."""

from __future__ import annotations

from rlaudit.config import Config


def unmapped_layout(cfg: Config) -> dict[str, bool]:
    """reason -> whether ``cfg`` sets it: the overlong buffer, row shuffling, length balancing,
    padding micro-batches, context parallelism and distillation."""
    act, t = cfg.actor, cfg.trainer
    return {
        "reward.overlong_buffer": cfg.reward.overlong_buffer.enable,
        "actor.shuffle": act.shuffle,
        "trainer.balance_batch": t.balance_batch,
        "padding micro-batches (trainer.extra_padding_microbatches)":
            t.extra_padding_microbatches > 0,
        "actor.context_parallel_size > 1": act.context_parallel_size > 1,
        "distillation": act.distill.enable,
    }
