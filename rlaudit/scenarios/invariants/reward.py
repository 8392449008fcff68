"""The reward manager and DAPO dynamic sampling, re-derived by naive loops (family 5 for the
reward-side config: overlong buffer, group filter, KL in reward)."""

from __future__ import annotations

import statistics

import torch

from rlaudit.algo.dapo import RAW_SCORE_METRICS
from rlaudit.data.io import load_rollout
from rlaudit.scenarios.invariants.base import (CheckContext, base_variant, invariant,
                                               not_applicable, result, with_overrides)
from rlaudit.update.step import select_groups
from rlaudit.verdict.tensors import compare_tensors

#: the variant that filters on the other kind of metric (see :func:`_other_metric_variants`)
OTHER_METRIC = "cfg:filter-metric"


def naive_overlong(length: int, max_len: int, buffer_len: int, factor: float) -> float:
    """DAPO: expected = max_len - buffer_len; penalty = min(-(len - expected) / buffer * f, 0)."""
    expected = max_len - buffer_len
    return min(-(length - expected) / buffer_len * factor, 0.0)


def naive_kept_uids(uids: list[int], metric: list[float]) -> set[int]:
    groups: dict[int, list[float]] = {}
    for u, m in zip(uids, metric):
        groups.setdefault(u, []).append(m)
    return {u for u, ms in groups.items() if len(ms) == 1 or statistics.pstdev(ms) > 0}


def _other_metric(metric: str) -> str:
    """The filter metric of the other kind: the raw score where the scenario filters on the
    penalised reward, and the reverse."""
    return "seq_reward" if metric in RAW_SCORE_METRICS else "score"


def _other_metric_variants(scn, batch):
    """With dynamic sampling and the overlong penalty both on, one more run (one step) filters on
    the other kind of metric (raw score <-> score plus penalty), when that keeps other groups of
    the rollout: a filter that reads the penalised reward where the raw score is configured (or
    the reverse) keeps the wrong groups on one of the two."""
    cfg = scn.config
    if not (cfg.algorithm.filter_groups.enable and cfg.reward.overlong_buffer.enable):
        return []
    other = with_overrides(cfg, **{"algorithm.filter_groups.metric":
                                   _other_metric(cfg.algorithm.filter_groups.metric)})
    rows, _ = select_groups(load_rollout(scn.rollout), other)
    if not len(rows) or not rows.num_tokens() or torch.equal(rows["uid"], batch["uid"]):
        return []
    return [base_variant(scn, rows, OTHER_METRIC, **{
        "algorithm.filter_groups.metric": other.algorithm.filter_groups.metric})]


def _expected(cfg, batch) -> tuple[torch.Tensor, list[float]]:
    """The token-level scores of ``batch`` under ``cfg`` ([B, R], score + penalty on the last
    response token) and the per-row penalties, by loops."""
    ob = cfg.reward.overlong_buffer
    lengths = batch["response_lengths"].tolist()
    penalties = [naive_overlong(n, cfg.rollout.response_length, ob.len, ob.penalty_factor)
                 if ob.enable else 0.0 for n in lengths]
    want = torch.zeros(batch.batch_size, batch.response_width, dtype=torch.float64)
    for i, (n, s, p) in enumerate(zip(lengths, batch["scores"].tolist(), penalties)):
        if n > 0:
            want[i, n - 1] = s + p
    return want, penalties


def _filter_problem(scn, cfg, batch) -> str | None:
    """Whether ``batch`` holds exactly the groups of the recorded rollout that DAPO's filter
    under ``cfg`` keeps (None), recomputed by loops; else what differs."""
    fg, ob = cfg.algorithm.filter_groups, cfg.reward.overlong_buffer
    if not fg.enable:
        return None
    raw = load_rollout(scn.rollout)
    raw_pen = [naive_overlong(n, cfg.rollout.response_length, ob.len, ob.penalty_factor)
               if ob.enable else 0.0 for n in raw["response_lengths"].tolist()]
    metric = [s + (0.0 if fg.metric in RAW_SCORE_METRICS else p)
              for s, p in zip(raw["scores"].tolist(), raw_pen)]
    kept = naive_kept_uids(raw["uid"].tolist(), metric)
    got = set(batch["uid"].tolist())
    if got == kept:
        return None
    return f"group filter kept uids {sorted(got)}, expected {sorted(kept)} (metric {fg.metric})"


def _shaping_problems(ctx: CheckContext, run, name: str) -> list[str]:
    """What is wrong with the scores ``run`` (of variant ``name``) trained on and its group
    filter (see :func:`reward_shaping`)."""
    scn = ctx.scenario
    cfg = scn.config if name == "base" else ctx.variant(name).config
    batch = ctx.batch_of(name)
    want, penalties = _expected(cfg, batch)
    problem = _filter_problem(scn, cfg, batch)
    problems = [problem] if problem else []
    ok, msg, _ = compare_tensors("token_level_scores", run.tokens["token_level_scores"], want,
                                 scn.tol("token_level_scores"))
    if not ok:
        problems.append(msg)
    if cfg.reward.overlong_buffer.enable:
        got_mean = run.steps[0].get("train/overlong_penalty_mean")
        want_mean = sum(penalties) / len(penalties) if penalties else 0.0
        if got_mean is None or not scn.tol("train/overlong_penalty_mean").close(got_mean,
                                                                               want_mean):
            problems.append(f"train/overlong_penalty_mean = {got_mean}, expected {want_mean:.10g}")
    return problems


def filter_metric_off(scn) -> str | None:
    """filter-metric's trigger: the group filter and the overlong penalty both on (only then do
    the raw score and the penalised reward differ)."""
    cfg = scn.config
    if cfg.algorithm.filter_groups.enable and cfg.reward.overlong_buffer.enable:
        return None
    return ("needs algorithm.filter_groups.enable and reward.overlong_buffer.enable, and a "
            "rollout on which the raw score and the penalised reward keep other groups")


def _what_was_checked(cfg) -> str:
    """The parts of reward-shaping that are on in ``cfg``: the score placement always, the
    overlong penalty and the group filter only when enabled (a check names only what it
    checked)."""
    parts = ["scores on the last response token"]
    if cfg.reward.overlong_buffer.enable:
        parts.append("overlong penalty and its mean")
    if cfg.algorithm.filter_groups.enable:
        parts.append("group filter")
    return ", ".join(parts[:-1]) + " and " + parts[-1] if len(parts) > 1 else parts[0]


@invariant("reward-shaping", "config-effect")
def reward_shaping(ctx: CheckContext):
    """The token-level scores each backend trained on are the rule score plus (when enabled) the
    DAPO overlong penalty ``min(-(len - (max_len - buffer)) / buffer * factor, 0)``, placed on the
    last response token and nowhere else; ``train/overlong_penalty_mean`` is its mean; and when
    dynamic sampling is on, the replayed rows are exactly the prompt groups of the recorded
    rollout whose filter metric has non-zero spread (or a single row) — all recomputed by loops.
    The message names only the parts that were on (the score placement is always checked).
    """
    checked = _what_was_checked(ctx.scenario.config)
    out = []
    for b in ctx.backends():
        runs, na = ctx.need("reward-shaping", b, "base")
        if na:
            out.append(na)
            continue
        problems = _shaping_problems(ctx, runs[0], "base")
        out.append(result("reward-shaping", b, not problems, "; ".join(problems) or
                          f"{checked} as specified"))
    return out


@invariant("filter-metric", "config-effect", variants=_other_metric_variants,
           trigger=filter_metric_off)
def filter_metric(ctx: CheckContext):
    """DAPO's group filter reads the metric configured (``algorithm.filter_groups.metric``): with
    the overlong penalty on, the raw score (``acc``, ``score``) and the penalised reward
    (``seq_reward``, ``seq_final_reward``) differ, and a run filtering on the other kind than
    the scenario's (``cfg:filter-metric``, one step) keeps exactly the groups whose metric of
    that kind has spread, and trains on their shaped scores as reward-shaping says. A filter that
    always adds the penalty, or never does, keeps the wrong groups on one of the two runs."""
    other = ctx.variant(OTHER_METRIC)
    if other is None:
        why = ("the raw score and the penalised reward keep the same groups of this rollout (or "
               "the other keeps none)")
        return [not_applicable("filter-metric", b, why) for b in ctx.backends()]
    metric = other.config.algorithm.filter_groups.metric
    out = []
    for b in ctx.backends():
        runs, na = ctx.need("filter-metric", b, OTHER_METRIC)
        if na:
            out.append(na)
            continue
        problems = _shaping_problems(ctx, runs[0], OTHER_METRIC)
        out.append(result("filter-metric", b, not problems,
                          f"filtering on {metric}: " + ("; ".join(problems) or
                                                        "the groups with spread kept, "
                                                        "scores as specified")))
    return out
