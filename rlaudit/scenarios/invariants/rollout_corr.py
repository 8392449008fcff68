"""Rollout correction (config effect, family 5): the importance-weight level, thresholds and the
rollout-KL loss act as specified, re-derived by naive loops from the trainer's own log-probs and
the engine's.

It only says something when the rollout really differs from the trainer's policy: with a vLLM
replay of the same weights every log-ratio is ~1e-6, every weight ~1, and any level passes. The
``short-stale`` rollout (sampled by an older snapshot) has log-ratios of O(0.1..1).
"""

from __future__ import annotations

import math

import torch

from rlaudit.scenarios.invariants.base import (CheckContext, base_variant, invariant,
                                               not_applicable, result)
from rlaudit.scenarios.invariants.logged import logged_agg, microbatch_rows
from rlaudit.scenarios.invariants.naive import naive_agg, naive_kl
from rlaudit.scenarios.invariants.seeds import one_minibatch

LEVELS = ("token", "sequence", "geometric")
#: verl's SAFETY_BOUND: log importance ratios are clamped to [-20, 20] before exp()
SAFETY_BOUND = 20.0


def naive_is_weights(old: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor, *, level: str,
                     threshold: float | None, mode: str, lower: float | None
                     ) -> tuple[list[list[float]], list[list[bool]]]:
    """IS weights and outside-the-bounds flags by loops over rows and tokens (0 / False where
    the mask is False)."""
    weights, outside = [], []
    for i in range(old.shape[0]):
        valid = [t for t in range(old.shape[1]) if mask[i, t]]
        d = {t: float(old[i, t]) - float(rollout[i, t]) for t in valid}
        row_sum = sum(d.values())
        w_row, o_row = [0.0] * old.shape[1], [False] * old.shape[1]
        for t in valid:
            log_w = {"token": d[t], "sequence": row_sum,
                     "geometric": row_sum / len(valid)}[level]
            w = math.exp(min(max(log_w, -SAFETY_BOUND), SAFETY_BOUND))
            if threshold is not None:
                if mode == "truncate" and w > threshold:
                    w, o_row[t] = threshold, True
                elif mode == "mask":
                    low = 1.0 / threshold if lower is None else lower
                    if not low <= w <= threshold:
                        w, o_row[t] = 0.0, True
            w_row[t] = w
        weights.append(w_row)
        outside.append(o_row)
    return weights, outside


def _variants(scn, batch):
    o = one_minibatch(scn, batch)
    return [base_variant(scn, batch, f"is:{level}", **o,
                         **{"actor.rollout_correction.rollout_is": level})
            for level in LEVELS]


@invariant("rollout-correction", "config-effect", variants=_variants)
def rollout_correction(ctx: CheckContext):
    """For each IS level (``token``: exp(d_t); ``sequence``: exp(sum_t d_t), the product of the
    token ratios; ``geometric``: exp(sum_t d_t / n), their geometric mean; ``d = old_log_prob -
    rollout_log_prob``, clamped to [-20, 20]) with the scenario's threshold and mode (truncate:
    min(w, threshold); mask: 0 outside [lower, threshold]), on one on-policy step over the whole
    batch: the per-token ``rollout_is_weights``, ``rollout_corr/is_weight_mean`` and
    ``is_clipfrac`` equal their recomputation by loops from the trainer's own initial-policy
    log-probs; ``actor/pg_loss`` equals ``agg(-A * w)`` with those recomputed weights; the
    mismatch metrics (``rollout_corr/kl``, ``k3_kl``, ``log_ppl_diff``,
    ``max_abs_log_prob_diff``) and, with the rollout-KL loss on, ``actor/rollout_kl`` equal
    their naive values. A sequence weight computed at another level (token ratios, a mean of
    log-ratios) fails here whatever the trainer reports."""
    scn = ctx.scenario
    if "rollout_log_probs" not in ctx.batch:
        return [not_applicable("rollout-correction", b, "the rollout has no rollout_log_probs")
                for b in ctx.backends()]
    rc = scn.config.actor.rollout_correction
    out = []
    for b in ctx.backends():
        names = [f"is:{level}" for level in LEVELS]
        runs, na = ctx.need("rollout-correction", b, *names)
        if na:
            out.append(na)
            continue
        problems, compared, figures = [], 0, []
        for level, name, run in zip(LEVELS, names, runs):
            old = run.tokens.get("old_log_probs", run.tokens.get("probe_log_probs"))
            if old is None:     # nothing to recompute the weights from (targets: n/a via NEEDS)
                continue
            mask, cfg = ctx.mask(name), ctx.variant(name).config
            rollout = ctx.batch_of(name)["rollout_log_probs"]
            micros = microbatch_rows(run, cfg, ctx.batch_of(name))
            w, want = _recomputed(level, old.double(), rollout.double(), mask, rc, cfg, run,
                                  micros)
            figures.append(f"{level}: mean w {want['rollout_corr/is_weight_mean']:.3g}, "
                           f"{want['rollout_corr/is_clipfrac']:.0%} outside")
            n, bad = _compare_level(scn, name, run, want, w, mask)
            compared += n
            problems += bad
        if not compared and not problems:
            out.append(not_applicable("rollout-correction", b, "no IS weight, IS metric or "
                                      "pg_loss reported to compare"))
            continue
        out.append(result("rollout-correction", b, not problems, "; ".join(problems[:3]) or
                          f"{compared} values agree with the recomputation ({'; '.join(figures)})"))
    return out


def _recomputed(level: str, old: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor, rc,
                cfg, run, micros=None) -> tuple[list[list[float]], dict[str, float]]:
    """The IS weights w [B][R] at ``level`` recomputed by loops from ``old`` and ``rollout``
    log-probs [B, R] (float64) under ``mask`` [B, R], and the metrics they imply: the weight mean
    over valid tokens, the clip fraction (per valid token at ``token`` level, per row with a
    valid token otherwise), the mismatch metrics, ``actor/pg_loss`` from the run's advantages
    (not for cispo) and ``actor/rollout_kl`` when that loss is on. ``rc``: the scenario's
    rollout-correction settings (threshold, mode); ``cfg``: the variant's config; ``micros``:
    the run's micro-batch rows, for a metric the config reduces as a micro-batch mean."""
    kl = cfg.actor.rollout_correction
    w, outside = naive_is_weights(old, rollout, mask, level=level,
                                  threshold=rc.rollout_is_threshold, mode=rc.rollout_is_mode,
                                  lower=rc.rollout_is_threshold_lower)
    w_t = torch.tensor(w, dtype=torch.float64)
    n_tok = int(mask.sum())
    want = {"rollout_corr/is_weight_mean": float(w_t[mask].sum()) / max(n_tok, 1)}
    out_rows = [any(r) for r in outside]
    if level == "token":
        want["rollout_corr/is_clipfrac"] = sum(map(sum, outside)) / max(n_tok, 1)
    else:
        rows = [bool(mask[i].any()) for i in range(len(outside))]
        want["rollout_corr/is_clipfrac"] = (sum(o for o, r in zip(out_rows, rows) if r)
                                            / max(sum(rows), 1))
    want.update(_mismatch(old, rollout, mask))
    if "advantages" in run.tokens and cfg.actor.loss_mode != "cispo":
        want["actor/pg_loss"] = naive_agg(-run.tokens["advantages"].double() * w_t, mask,
                                          cfg.actor.loss_agg_mode, cfg.actor.loss_scale_factor)
    if kl.use_rollout_kl_loss:
        mat = naive_kl(old, rollout, kl.rollout_kl_loss_type, k3_clamp=cfg.algorithm.k3_clamp)
        # as the run logs it (a micro-batch mean when the config says so; rows unknown: skip)
        value = None if mat is None else logged_agg("actor/rollout_kl", mat, mask, cfg, micros)
        if value is not None:
            want["actor/rollout_kl"] = value
    return w, want


def _compare_level(scn, name: str, run, want: dict[str, float], w: list[list[float]],
                   mask: torch.Tensor) -> tuple[int, list[str]]:
    """(values compared, problems): the run's step-0 metrics against ``want`` and its per-token
    ``rollout_is_weights`` [B, R] against ``w`` where ``mask`` [B, R] is True."""
    compared, problems = 0, []
    got = run.steps[0]
    for metric, value in want.items():
        if metric not in got:
            continue
        compared += 1
        if not scn.tol(metric).close(got[metric], value):
            problems.append(f"{name}: {metric} = {got[metric]:.10g}, recomputed {value:.10g}")
    tw = run.tokens.get("rollout_is_weights")
    if tw is not None:
        compared += 1
        w_t = torch.tensor(w, dtype=torch.float64)
        tol = scn.tol("rollout_is_weights")
        bad = mask & ((tw.double() - w_t).abs() > tol.atol + tol.rtol * w_t.abs())
        if bool(bad.any()):
            i, t = [int(x) for x in bad.nonzero()[0]]
            problems.append(f"{name}: rollout_is_weights[{i}, {t}] = {float(tw[i, t]):.6g}, "
                            f"recomputed {w[i][t]:.6g} ({int(bad.sum())} tokens differ)")
    return compared, problems


def _mismatch(old: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """The mismatch metrics by loops: token-means of -d and exp(d) - d - 1 (d clamped above at
    20), mean over non-empty rows of (row mean rollout - row mean old), max |d|."""
    ds, rows = [], []
    for i in range(old.shape[0]):
        row = [float(old[i, t]) - float(rollout[i, t]) for t in range(old.shape[1]) if mask[i, t]]
        ds += row
        if row:
            rows.append(-sum(row) / len(row))
    n = max(len(ds), 1)
    return {"rollout_corr/kl": sum(-d for d in ds) / n,
            "rollout_corr/k3_kl": sum(math.exp(min(d, SAFETY_BOUND)) - min(d, SAFETY_BOUND) - 1
                                      for d in ds) / n,
            "rollout_corr/log_ppl_diff": sum(rows) / len(rows) if rows else 0.0,
            "rollout_corr/max_abs_log_prob_diff": max((abs(d) for d in ds), default=0.0)}
