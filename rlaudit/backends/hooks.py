"""Forward hooks that record what each hooked module outputs and the gradient reaching it: the
drift localisation's layer probe (rlaudit/backends/probe.py on HF models,
rlaudit/backends/megatron/probe.py on megatron-core ones). Shapes: an output is recorded as the
module returns it (batch-first ``[b, s, ...]`` for HF, sequence-first ``[s, b, ...]`` for
megatron: ``batch_dim``), cut to its first rows, then first positions (:func:`cut`)."""

from __future__ import annotations

from functools import partial

import torch

#: elements kept over all hooked outputs (and as many again for their gradients): each module's
#: share is cut to its first rows, then to its first positions (a large model's hidden states or
#: a large vocabulary's logits); the localisation compares what both sides kept
MAX_PROBE_ELEMENTS = 1 << 27


def hf_module_names(model: torch.nn.Module) -> list[str]:
    """The modules of an HF causal LM the layer probe hooks, in depth order."""
    have = {n for n, _ in model.named_modules()}
    names = ["model.embed_tokens"]
    i = 0
    while f"model.layers.{i}" in have:
        names += [f"model.layers.{i}.{part}" for part in
                  ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp")]
        names.append(f"model.layers.{i}")
        i += 1
    names += ["model.norm", "lm_head"]
    return [n for n in names if n in have]


def cut(t: torch.Tensor, batch_dim: int, seq_dim: int, cap: int) -> torch.Tensor:
    """``t`` narrowed to at most ``cap`` elements: its first rows, and if one row is still too
    large, its first positions (both sides of a comparison cut alike)."""
    if t.numel() <= cap or t.dim() <= max(batch_dim, seq_dim):
        return t
    per_row = t.numel() // max(t.shape[batch_dim], 1)
    t = t.narrow(batch_dim, 0, max(1, cap // max(per_row, 1)))
    if t.numel() > cap:
        per_pos = t.numel() // max(t.shape[seq_dim], 1)
        t = t.narrow(seq_dim, 0, max(1, cap // max(per_pos, 1)))
    return t


class ModuleHooks:
    """Forward hooks on ``modules`` (name -> module) recording each output (the first tensor of a
    tuple output) and, through a tensor hook, the gradient that reaches it; each within its share
    of :data:`MAX_PROBE_ELEMENTS`. ``batch_dim``: 0 for batch-first outputs, 1 for megatron's
    sequence-first ones."""

    def __init__(self, modules: dict[str, torch.nn.Module], *, batch_dim: int = 0):
        self.outputs: dict[str, torch.Tensor] = {}
        self.grads: dict[str, torch.Tensor] = {}
        self._dims = (batch_dim, 1 - batch_dim)
        self._cap = max(1 << 16, MAX_PROBE_ELEMENTS // max(len(modules), 1))
        self._handles = [m.register_forward_hook(self._hook(n)) for n, m in modules.items()]

    def _hook(self, name: str):
        def hook(module, args, output):
            t = output[0] if isinstance(output, (tuple, list)) else output
            if not isinstance(t, torch.Tensor):
                return
            self.outputs[name] = cut(t.detach(), *self._dims, self._cap).clone()
            if t.requires_grad:
                t.register_hook(partial(self._grad, name))
        return hook

    def _grad(self, name: str, grad: torch.Tensor) -> None:
        self.grads[name] = cut(grad.detach(), *self._dims, self._cap).clone()

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
