"""From a micro-batch to model inputs, and from per-position model outputs to response-aligned
per-token tensors.

Layout (see rlaudit/data/batch.py): row i's model input is ``prompt_i ++ response_i``,
right-padded to ``S = max_i(prompt_len_i + response_len_i)``; position ids are ``0..S-1`` on every
row (no left padding, so every backend — HF, FSDP, Megatron, which ignores position ids — sees the
same positions). The output at position ``s`` predicts the token at ``s + 1``, so response token
``t`` of row i is scored at position ``prompt_len_i - 1 + t``.

These helpers are shared by every backend; only "run the model" differs between them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlaudit.algo.logprob import log_probs_at, logprobs_from_logits
from rlaudit.data.batch import RolloutBatch


@dataclass(frozen=True)
class ModelInputs:
    """input_ids [b, S] int64 (pad id 0 after each row's tokens); attention_mask [b, S] bool (True =
    real token); position_ids [b, S]; labels [b, S] = input_ids shifted left (the token each
    position predicts; the last column is a dummy 0); gather_index [b, R] = position scoring response
    token t (clamped into range where t >= response length: those entries are masked out)."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    position_ids: torch.Tensor
    labels: torch.Tensor
    gather_index: torch.Tensor
    valid: torch.Tensor  # [b, R] bool: t < response_length (the token exists)


def build_inputs(micro: RolloutBatch, *, pad_id: int = 0, multiple_of: int = 1) -> ModelInputs:
    """Concatenate prompt and response per row (right padding). ``multiple_of`` rounds S up (e.g.
    for tensor-parallel sequence constraints); padding never changes real positions' outputs."""
    prompt_ids, response_ids = micro["prompt_ids"], micro["response_ids"]
    pl, rl = micro["prompt_lengths"].long(), micro["response_lengths"].long()
    b, p = prompt_ids.shape
    r = response_ids.shape[1]
    device = prompt_ids.device
    seq_len = max(int((pl + rl).max()) if b else 1, 2)
    seq_len = -(-seq_len // multiple_of) * multiple_of

    cols = torch.arange(seq_len, device=device).unsqueeze(0)                    # [1, S]
    in_prompt = cols < pl.unsqueeze(1)                                          # [b, S]
    resp_col = (cols - pl.unsqueeze(1)).clamp(0, r - 1)                         # [b, S]
    in_resp = (cols >= pl.unsqueeze(1)) & (cols < (pl + rl).unsqueeze(1))
    prompt_part = prompt_ids.gather(1, cols.clamp(max=p - 1).expand(b, -1))
    resp_part = response_ids.gather(1, resp_col)
    zeros = torch.full_like(prompt_part, pad_id)
    input_ids = torch.where(in_prompt, prompt_part, torch.where(in_resp, resp_part, zeros))
    attention_mask = in_prompt | in_resp
    labels = torch.cat([input_ids[:, 1:], torch.zeros_like(input_ids[:, :1])], 1)

    t = torch.arange(r, device=device).unsqueeze(0)
    gather_index = (pl.unsqueeze(1) - 1 + t).clamp(0, seq_len - 1)
    valid = t < rl.unsqueeze(1)
    return ModelInputs(input_ids, attention_mask, cols.expand(b, -1).contiguous(), labels,
                       gather_index, valid)


def response_gather(per_position: torch.Tensor, inputs: ModelInputs) -> torch.Tensor:
    """[b, S, ...] per-position values -> [b, R, ...] per response token; 0 where the token does
    not exist (t >= response length), so masked entries are deterministic across backends."""
    idx = inputs.gather_index
    if per_position.dim() > 2:
        idx = idx.view(*idx.shape, *([1] * (per_position.dim() - 2))).expand(
            *idx.shape, *per_position.shape[2:])
    out = per_position.gather(1, idx)
    valid = inputs.valid.view(*inputs.valid.shape, *([1] * (out.dim() - 2)))
    return torch.where(valid, out, torch.zeros((), dtype=out.dtype, device=out.device))


def logprobs_from_position_logits(logits: torch.Tensor, inputs: ModelInputs, *, temperature: float,
                                  calc_entropy: bool, chunk_size: int
                                  ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """logits [b, S, V] (full vocab) -> (log_probs [b, R], entropy [b, R] or None).

    Log-probs/entropy are computed at every position against ``labels`` (no copy of the logits is
    made), then gathered to response tokens."""
    logp, ent = logprobs_from_logits(logits, inputs.labels, temperature=temperature,
                                     calc_entropy=calc_entropy, chunk_size=chunk_size)
    return response_gather(logp, inputs), (response_gather(ent, inputs) if ent is not None else None)


def topk_logprobs_from_position_logits(logits: torch.Tensor, inputs: ModelInputs,
                                       ids: torch.Tensor, *, temperature: float,
                                       chunk_size: int) -> torch.Tensor:
    """Log-probs at given ids per response token: ``ids`` [b, R, K] -> [b, R, K] (top-k
    distillation). Only the response positions' logits are gathered ([b, R, V])."""
    idx = inputs.gather_index.unsqueeze(-1).expand(-1, -1, logits.shape[-1])
    resp_logits = logits.gather(1, idx)
    out = log_probs_at(resp_logits, ids, temperature=temperature, chunk_size=chunk_size)
    return torch.where(inputs.valid.unsqueeze(-1), out, torch.zeros((), dtype=out.dtype))


def hf_logits(model, inputs: ModelInputs) -> torch.Tensor:
    """Run a Hugging Face causal LM: [b, S, V] logits in the model's dtype."""
    out = model(input_ids=inputs.input_ids, attention_mask=inputs.attention_mask.long(),
                position_ids=inputs.position_ids, use_cache=False)
    return out.logits
