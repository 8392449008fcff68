"""Make a float64 Hugging Face model compute in float64 throughout.

Stock HF Qwen2/Llama keep float32 islands inside a float64 model: RMSNorm computes its variance
in float32 and eager attention runs its softmax in float32. A float64 "reference" is then only
float32-accurate (~1e-5 on logits), and worse for an audit, its results depend on things that
must not matter: the intra-op thread count (float32 reductions split differently) and the padded
sequence length of the micro-batch (the float32 softmax over a longer row). Both would show up as
false alarms in parity and metamorphic checks at float64 tolerances.

:func:`exact_float64` fixes this per model instance (no global monkeypatching): RMSNorm modules
get a float64-preserving forward and attention switches to SDPA, which computes in the input
dtype. Rotary cos/sin stay as HF computes them (float32 frequencies cast to the model dtype):
they depend only on positions, so they cannot make results depend on batching, and Megatron
computes them the same way.
"""

from __future__ import annotations

import types

import torch


def _rms_norm_same_dtype(self, hidden_states: torch.Tensor) -> torch.Tensor:
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))


def exact_float64(model: torch.nn.Module) -> torch.nn.Module:
    """Patch ``model`` in place (float64 models only; others are returned unchanged)."""
    if next(model.parameters()).dtype != torch.float64:
        return model
    for module in model.modules():
        if type(module).__name__.endswith("RMSNorm") and hasattr(module, "variance_epsilon"):
            module.forward = types.MethodType(_rms_norm_same_dtype, module)
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation("sdpa")
    return model
