"""The reward manager and DAPO dynamic sampling, re-derived by naive loops (family 5 for the
reward-side config: overlong buffer, group filter, KL in reward)."""

from __future__ import annotations

import statistics

import torch

from rlaudit.data.io import load_rollout
from rlaudit.scenarios.invariants.base import CheckContext, compare_tensors, invariant, result


def naive_overlong(length: int, max_len: int, buffer_len: int, factor: float) -> float:
    """DAPO: expected = max_len - buffer_len; penalty = min(-(len - expected) / buffer * f, 0)."""
    expected = max_len - buffer_len
    return min(-(length - expected) / buffer_len * factor, 0.0)


def naive_kept_uids(uids: list[int], metric: list[float]) -> set[int]:
    groups: dict[int, list[float]] = {}
    for u, m in zip(uids, metric):
        groups.setdefault(u, []).append(m)
    return {u for u, ms in groups.items() if len(ms) == 1 or statistics.pstdev(ms) > 0}


@invariant("reward-shaping", "config-effect")
def reward_shaping(ctx: CheckContext):
    """The token-level scores each backend trained on are the rule score plus (when enabled) the
    DAPO overlong penalty ``min(-(len - (max_len - buffer)) / buffer * factor, 0)``, placed on the
    last response token and nowhere else; ``train/overlong_penalty_mean`` is its mean; and when
    dynamic sampling is on, the replayed rows are exactly the prompt groups of the recorded
    rollout whose filter metric has non-zero spread (or a single row) — all recomputed by loops."""
    scn = ctx.scenario
    cfg = scn.config
    ob = cfg.reward.overlong_buffer
    batch = ctx.batch
    lengths = batch["response_lengths"].tolist()
    penalties = [naive_overlong(n, cfg.rollout.response_length, ob.len, ob.penalty_factor)
                 if ob.enable else 0.0 for n in lengths]
    want = torch.zeros(batch.batch_size, batch.response_width, dtype=torch.float64)
    for i, (n, s, p) in enumerate(zip(lengths, batch["scores"].tolist(), penalties)):
        if n > 0:
            want[i, n - 1] = s + p
    filter_problem = None
    fg = cfg.algorithm.filter_groups
    if fg.enable:
        raw = load_rollout(scn.rollout)
        raw_pen = [naive_overlong(n, cfg.rollout.response_length, ob.len, ob.penalty_factor)
                   if ob.enable else 0.0 for n in raw["response_lengths"].tolist()]
        metric = [s + (0.0 if fg.metric in ("acc", "score") else p)
                  for s, p in zip(raw["scores"].tolist(), raw_pen)]
        kept = naive_kept_uids(raw["uid"].tolist(), metric)
        got = set(batch["uid"].tolist())
        if got != kept:
            filter_problem = (f"group filter kept uids {sorted(got)}, expected {sorted(kept)} "
                              f"(metric {fg.metric})")
    out = []
    for b in ctx.backends():
        runs, na = ctx.need("reward-shaping", b, "base")
        if na:
            out.append(na)
            continue
        run = runs[0]
        problems = [filter_problem] if filter_problem else []
        ok, msg, _ = compare_tensors("token_level_scores", run.tokens["token_level_scores"], want,
                                     scn.tol("token_level_scores"))
        if not ok:
            problems.append(msg)
        if ob.enable:
            got_mean = run.steps[0].get("train/overlong_penalty_mean")
            want_mean = sum(penalties) / len(penalties) if penalties else 0.0
            if got_mean is None or not scn.tol("train/overlong_penalty_mean").close(got_mean,
                                                                                   want_mean):
                problems.append(f"train/overlong_penalty_mean = {got_mean}, expected {want_mean:.10g}")
        out.append(result("reward-shaping", b, not problems, "; ".join(problems) or
                          f"scores, overlong penalty{' and group filter' if fg.enable else ''} "
                          f"as specified"))
    return out
