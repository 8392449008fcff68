"""Sanity bounds (family 8), rollout parity (family 7) and distributed health (family 10)."""

from __future__ import annotations

import math

import torch

from rlaudit.metrics import CATALOGUE
from rlaudit.model.load import snapshot_id
from rlaudit.scenarios.invariants.base import CheckContext, invariant, not_applicable, result
from rlaudit.verdict.compare import NOISE_FACTOR, masked_spread
from rlaudit.verdict.tensors import compare_tensors
from rlaudit.verdict.tolerance import Tolerance

#: slack for bounds checks on values that are exact in theory (fractions, entropy >= 0)
BOUND_SLACK = 1e-9


@invariant("sanity-bounds", "sanity")
def sanity_bounds(ctx: CheckContext):
    """Every logged metric is catalogued, finite and inside its catalogue bounds (fractions in
    [0, 1], entropy >= 0, k3 KL >= 0, grad norms >= 0, ...), in every variant and step; per-token
    entropy is >= 0 on valid tokens — each variant's tensors read under that variant's own mask
    (a permuted or widened variant has its own; values under mask 0 are the trainer's business)."""
    out = []
    for b in ctx.backends():
        problems = []
        for vname, run in ctx.runs[b].items():
            for step, metrics in enumerate(run.steps):
                for name, value in metrics.items():
                    spec = CATALOGUE.get(name)
                    if spec is None:
                        problems.append(f"{vname} step {step}: metric {name!r} is not in the "
                                        f"catalogue")
                    elif not math.isfinite(value):
                        problems.append(f"{vname} step {step}: {name} = {value}")
                    elif not spec.low - BOUND_SLACK <= value <= spec.high + BOUND_SLACK:
                        problems.append(f"{vname} step {step}: {name} = {value:.6g} outside "
                                        f"[{spec.low}, {spec.high}]")
            ent = run.tokens.get("probe_entropy")
            if ent is None:
                continue
            mask = ctx.mask(vname)
            if ent.shape != mask.shape:
                problems.append(f"{vname}: per-token entropy has shape {tuple(ent.shape)}, the "
                                f"variant's batch {tuple(mask.shape)}")
            else:
                low = float(torch.where(mask, ent.double(), torch.zeros((), dtype=torch.float64)).min())
                if low < -BOUND_SLACK:
                    problems.append(f"{vname}: per-token entropy {low:.3g} < 0")
        out.append(result("sanity-bounds", b, not problems, "; ".join(problems[:3]) +
                          (f" (+{len(problems) - 3} more)" if len(problems) > 3 else "")
                          if problems else "all metrics catalogued, finite and in bounds"))
    return out


#: default sampling-vs-training log-prob tolerance by the engine that recorded the rollout
ROLLOUT_TOLERANCES = {"vllm": Tolerance(0.0, 5e-3), "reference": Tolerance(0.0, 1e-4)}


@invariant("rollout-parity", "rollout")
def rollout_parity(ctx: CheckContext):
    """The sampling engine's log-probs (``rollout_log_probs``, recorded with the rollout) match
    the trainer's recomputation with the same weights and temperature on every valid token (n/a
    when the rollout's sidecar names another model snapshot: an off-policy rollout):
    a mismatch means the engine and trainer disagree about the policy (temperature applied twice,
    wrong logprobs mode, different weights, numerics)."""
    out = []
    if "rollout_log_probs" not in ctx.batch:
        return [not_applicable("rollout-parity", b, "rollout has no rollout_log_probs")
                for b in ctx.backends()]
    engine = str(ctx.batch.meta.get("engine", "reference"))
    scn = ctx.scenario
    sampled_by = ctx.batch.meta.get("model_snapshot_id")
    if sampled_by and scn.model is not None:
        if snapshot_id(scn.model) != sampled_by:
            why = (f"the rollout was sampled by another snapshot ({ctx.batch.meta.get('model')}, "
                   f"id {sampled_by}) than the scenario's model: off-policy by design")
            return [not_applicable("rollout-parity", b, why) for b in ctx.backends()]
    tol = (scn.tolerances.get("rollout_log_probs")
           or ROLLOUT_TOLERANCES.get(engine, ROLLOUT_TOLERANCES["vllm"]))
    slack = _log_prob_noise(ctx)
    for b in ctx.backends():
        runs, na = ctx.need("rollout-parity", b, "base")
        if na:
            out.append(na)
            continue
        run = runs[0]
        batch = ctx.batch_of("base")
        ok, msg, det = compare_tensors("rollout_log_probs vs trainer", batch["rollout_log_probs"],
                                       run.tokens["probe_log_probs"], tol, batch.mask,
                                       slack=slack)
        out.append(result("rollout-parity", b, ok, f"engine {engine}: {msg}", det,
                          drift=det.get("max_abs_diff")))
    return out


def _log_prob_noise(ctx: CheckContext) -> float:
    """A target's measured noise floor on the step-0 log-probs (NOISE_FACTOR times the largest
    move of a valid token when the reference replays with its weights perturbed at the target's
    unit roundoff: rlaudit/targets/run/runner.py); 0 for rlaudit's own backends. A bf16 trainer's
    log-probs sit ~0.2 from an exact sampler's on these models, while the bugs this invariant
    exists for (temperature twice or missing, another policy) move them by whole units."""
    base = ctx.runs.get("reference", {}).get("base")
    noise = getattr(base, "noise", None)
    if noise is None or "probe_log_probs" not in noise.tokens or \
            "probe_log_probs" not in base.tokens:
        return 0.0
    return NOISE_FACTOR * masked_spread(noise.tokens["probe_log_probs"],
                                        base.tokens["probe_log_probs"],
                                        ctx.batch_of("base").mask)


@invariant("distributed-health", "distributed")
def distributed_health(ctx: CheckContext):
    """Every rank runs the same number of forward/backward passes in every optimizer step of
    every variant (padding micro-batches make up the difference), so no collective can
    desynchronise; a rank that raised or died is reported with its traceback by the launcher.
    Where a backend reports them (Megatron): every rank logs the same metrics, and every rank
    holds the same full model initially and after every step -- data-parallel replicas that
    drift apart (a rank that skips its optimizer step or its gradient all-reduce, or steps with
    other settings) would otherwise go unseen, since results are read from rank 0."""
    out = []
    for b in ctx.backends():
        problems, ranks_seen = [], 1
        for vname, run in ctx.runs[b].items():
            for step, ranks in enumerate(run.micro_log):
                ranks_seen = max(ranks_seen, len(ranks))
                counts = [[len(m) for m in r] for r in ranks]
                if any(c != counts[0] for c in counts):
                    problems.append(f"{vname} step {step}: micro-batches per optimizer step differ "
                                    f"across ranks: {counts}")
            if run.info.get("rank_metrics_agree") is False:
                problems.append(f"{vname}: ranks logged different metrics (rank 0's are reported)")
            for when, ranks in (run.info.get("rank_params_differ") or {}).items():
                problems.append(f"{vname} {when}: rank(s) {', '.join(map(str, ranks))} hold other "
                                f"parameters than rank 0 (replicas drifted apart)")
        if ranks_seen == 1 and not problems:
            out.append(not_applicable("distributed-health", b, "one rank"))
            continue
        out.append(result("distributed-health", b, not problems, "; ".join(problems[:3]) or
                          f"{ranks_seen} ranks ran equally many passes in every optimizer step"))
    return out
