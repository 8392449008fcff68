"""Batch transforms that must not change a correct trainer's results (the metamorphic relations
of docs/internals.md, "Invariants and variants"): permuting rows, appending padding columns,
changing values nobody may read.

Every function returns a new batch; the input is untouched.
"""

from __future__ import annotations

import torch

from rlaudit.data.batch import Kind, RolloutBatch, pad_dim1

#: range of the garbage written under masks: large enough that any leak is visible, finite so
#: validation accepts the batch
GARBAGE_SCALE = 50.0


def permute_rows_within_blocks(batch: RolloutBatch, block: int, *, seed: int = 0
                               ) -> tuple[RolloutBatch, torch.Tensor]:
    """Shuffle rows inside consecutive blocks of ``block`` rows (so the rows that make up each
    mini-batch stay the same). Returns (new batch, perm) with ``new row i = old row perm[i]``."""
    g = torch.Generator().manual_seed(seed)
    parts = []
    for start in range(0, len(batch), block):
        n = min(block, len(batch) - start)
        parts.append(start + torch.randperm(n, generator=g))
    perm = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)
    return batch.select(perm), perm


def append_padding(batch: RolloutBatch, *, prompt_cols: int = 2, response_cols: int = 3
                   ) -> RolloutBatch:
    """Widen P and R with padding columns (ids 0, masks False, floats 0)."""
    out = {}
    for name, t in batch.tensors.items():
        kind = batch.kinds[name]
        if kind == Kind.PROMPT:
            out[name] = pad_dim1(t, t.shape[1] + prompt_cols)
        elif kind == Kind.TOKEN:
            out[name] = pad_dim1(t, t.shape[1] + response_cols)
        else:
            out[name] = t
    return RolloutBatch.from_tensors(out, kinds=dict(batch.kinds), meta=dict(batch.meta))


def perturb_masked(batch: RolloutBatch, *, seed: int = 0, vocab_size: int = 256) -> RolloutBatch:
    """Overwrite everything no correct computation may read: prompt ids past each prompt,
    response ids past each response, and every float per-token field where response_mask is
    False (holes inside responses included; their token ids stay, the model reads them)."""
    g = torch.Generator().manual_seed(seed)
    out = dict(batch.tensors)
    p_cols = torch.arange(batch.prompt_width).unsqueeze(0)
    r_cols = torch.arange(batch.response_width).unsqueeze(0)
    beyond_prompt = p_cols >= batch["prompt_lengths"].unsqueeze(1)
    beyond_resp = r_cols >= batch["response_lengths"].unsqueeze(1)
    noise_p = torch.randint(0, vocab_size, batch["prompt_ids"].shape, generator=g)
    out["prompt_ids"] = torch.where(beyond_prompt, noise_p.to(batch["prompt_ids"].dtype),
                                    batch["prompt_ids"])
    noise_r = torch.randint(0, vocab_size, batch["response_ids"].shape, generator=g)
    out["response_ids"] = torch.where(beyond_resp, noise_r.to(batch["response_ids"].dtype),
                                      batch["response_ids"])
    masked = ~batch.mask
    for name, t in batch.tensors.items():
        if batch.kinds[name] != Kind.TOKEN or not t.is_floating_point():
            continue
        m = masked.view(*masked.shape, *([1] * (t.dim() - 2))).expand_as(t)
        noise = -torch.rand(t.shape, generator=g, dtype=torch.float64) * GARBAGE_SCALE
        out[name] = torch.where(m, noise.to(t.dtype), t)
    return RolloutBatch.from_tensors(out, kinds=dict(batch.kinds), meta=dict(batch.meta))
