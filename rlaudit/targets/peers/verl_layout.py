"""rlaudit's batch in verl's sequence layout, as verl's rollout hands it to the trainer (shared by
the stage adapter, rlaudit/targets/peers/verl.py, and verl's training step, verl_train.py)."""

from __future__ import annotations

import torch

from rlaudit.data.batch import RolloutBatch


def verl_tensors(batch: RolloutBatch, width: int | None = None) -> dict[str, torch.Tensor]:
    """Every field of ``batch`` plus verl's sequence layout: ``input_ids`` / ``attention_mask``
    ``[B, P + R]`` with the prompt left-padded and the response right-padded (verl's rollout
    output), ``position_ids``, ``responses``.

    ``width``: the response width verl's rollout pads to (``rollout.response_length``; verl's
    metrics read the length limit off it): ``response_ids`` and ``response_mask`` are padded to
    it, or cut to it where every response ends before it (columns of padding only). Other
    per-token fields keep the batch's width R."""
    t = dict(batch.tensors)
    r = t["response_ids"].shape[1]
    longest = int(t["response_lengths"].max()) if len(t["response_lengths"]) else 0
    if width is not None and width != r and longest <= width:
        t["response_ids"] = _to_width(t["response_ids"], width)
        t["response_mask"] = _to_width(t["response_mask"], width)
    b, p = t["prompt_ids"].shape
    r = t["response_ids"].shape[1]
    pl, rl = t["prompt_lengths"], t["response_lengths"]
    cols_p = torch.arange(p).unsqueeze(0)
    prompt_mask = cols_p >= (p - pl).unsqueeze(1)                 # left padding
    src = (cols_p - (p - pl).unsqueeze(1)).clamp(min=0)
    prompts = torch.where(prompt_mask, t["prompt_ids"].gather(1, src), 0)
    resp_mask = torch.arange(r).unsqueeze(0) < rl.unsqueeze(1)
    attention = torch.cat([prompt_mask, resp_mask], dim=1).to(torch.int64)
    out = t
    out.update(input_ids=torch.cat([prompts, t["response_ids"]], dim=1), attention_mask=attention,
               position_ids=(attention.cumsum(1) - 1).clamp(min=0), responses=t["response_ids"])
    return out


def _to_width(x: torch.Tensor, width: int) -> torch.Tensor:
    """``x`` ``[B, R]`` cut or zero-padded on the right to ``[B, width]``."""
    if x.shape[1] >= width:
        return x[:, :width].clone()
    return torch.cat([x, x.new_zeros(x.shape[0], width - x.shape[1])], dim=1)


def to_batch_width(x: torch.Tensor, r: int) -> torch.Tensor:
    """A per-token tensor of verl's response width back to the batch's ``[B, r]`` (the cut
    columns were padding: zeros)."""
    return _to_width(x, r)


def dispatch_order(rows: int, mini_rows: int, dp: int) -> list[int]:
    """The order to hand ``rows`` rows to verl over ``dp`` ranks so that its optimizer steps
    train the reference's mini-batches: row ``order[p]`` goes to position ``p``.

    verl's dispatcher gives rank ``r`` the contiguous chunk ``[r R/dp, (r+1) R/dp)``
    (single_controller/base/decorator.py:77) and each rank cuts its own mini-batches of
    ``mini_rows / dp`` rows in order (workers/engine_workers.py:263-278), so optimizer step
    ``k`` trains, on rank ``r``, chunk rows ``[k m, (k+1) m)`` with ``m = mini_rows / dp``: in the
    rollout's own order, step 0 at dp 2 trains rows 0-3 and 8-11 of 16 (mini-batches of 8)
    where one rank trains 0-7. Placing reference row ``k M + r m + j`` at position
    ``r R/dp + k m + j`` makes step ``k`` train the reference's rows ``[k M, (k+1) M)`` on every
    dp (a layout of the dispatch, not a change of what verl computes)."""
    if rows % mini_rows or mini_rows % dp:
        raise ValueError(f"{rows} rows do not cut into mini-batches of {mini_rows} rows over "
                         f"{dp} rank(s)")
    m, chunk = mini_rows // dp, rows // dp
    order = [0] * rows
    for k in range(rows // mini_rows):
        for r in range(dp):
            for j in range(m):
                order[r * chunk + k * m + j] = k * mini_rows + r * m + j
    return order
