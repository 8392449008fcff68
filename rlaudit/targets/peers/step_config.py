"""What the peers' own training steps share: the layout settings of rlaudit's config that no
peer's step maps (verl, SkyRL, slime, AReaL), each named as the n/a reason its ``supports()``
gives (peer-specific refusals stay with each peer), and the wrapper the Megatron-based steps
(verl 0.7's actor, slime) put around a GPTModel."""

from __future__ import annotations

import torch

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


class WrappedGPT(torch.nn.Module):
    """A megatron-core GPTModel behind a peer-facing ``forward`` of a subclass's own: every
    other attribute is the GPTModel's, and ``module`` is it (megatron's
    ``get_attr_wrapped_model`` unwraps through ``module``)."""

    def __init__(self, gpt):
        super().__init__()
        self.module = gpt

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(super().__getattr__("module"), name)

    def set_input_tensor(self, tensor) -> None:
        self.module.set_input_tensor(tensor)
