"""The critic: a causal LM's transformer body with a scalar value head (what verl's critic is).

``ValueModel(lm)`` takes the backbone of a Hugging Face causal LM (``lm.model``) and adds a
``Linear(hidden, 1)`` head; ``forward`` returns per-position values [b, S]. The value of response
token t is read at the same position that scores it (``prompt_len - 1 + t``): V of the state
before the token is emitted.
"""

from __future__ import annotations

import torch
from torch import nn

#: std of the value head's initial weights: small, so initial values are near 0 but not all equal
VALUE_HEAD_INIT_STD = 0.02


class ValueModel(nn.Module):
    def __init__(self, lm: nn.Module, *, seed: int = 0):
        super().__init__()
        self.backbone = lm.model
        hidden = lm.config.hidden_size
        dtype = next(lm.parameters()).dtype
        self.value_head = nn.Linear(hidden, 1, bias=True, dtype=dtype)
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            self.value_head.weight.copy_(torch.randn(self.value_head.weight.shape, generator=g,
                                                     dtype=torch.float64) * VALUE_HEAD_INIT_STD)
            self.value_head.bias.zero_()
        self.config = lm.config

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        hidden = self.backbone(input_ids=input_ids, attention_mask=attention_mask,
                               position_ids=position_ids, use_cache=False).last_hidden_state
        return self.value_head(hidden).squeeze(-1)
