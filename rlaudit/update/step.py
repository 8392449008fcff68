"""One RL training step on a batch of trajectories, from scores to updated weights.

    prepare_batch:  reward (scores + DAPO overlong penalty, placed on the last token)
                    -> old log-probs (actor, no grad) -> reference log-probs -> values (critic)
                    -> KL in reward (out of place) -> rollout importance weights -> advantages
    train_step:     prepare_batch -> critic update -> actor update -> metrics

The same function runs in the reference trainer (after generation and group filtering) and in
every backend's replay of a fixed rollout; backends differ only in the contexts they pass.
Batch-level math runs identically on every rank on the whole batch (it is deterministic), forward
passes are split over data-parallel ranks and gathered.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch

from rlaudit.algo.advantages import compute_advantages
from rlaudit.algo.agg import masked_mean
from rlaudit.algo.dapo import RAW_SCORE_METRICS, filter_groups, overlong_penalty
from rlaudit.algo.reward import apply_kl_in_reward, place_scores, reward_function_means
from rlaudit.algo.rollout_corr import is_metrics, mismatch_metrics, rollout_is_weights
from rlaudit.config import Config
from rlaudit.data.batch import RolloutBatch
from rlaudit.data.rewards import MASK, SCORES, reward_functions
from rlaudit.errors import InputError
from rlaudit.update.actor import compute_log_probs, update_actor
from rlaudit.update.context import ParallelContext
from rlaudit.update.critic import compute_values, update_critic


@dataclass
class Roles:
    """The models of a step. ``ref`` may be None when no stage needs reference log-probs (then
    a batch must already carry ``ref_log_probs`` if KL is used); ``critic`` only for GAE."""

    actor: ParallelContext
    ref: ParallelContext | None = None
    critic: ParallelContext | None = None


@dataclass
class StepResult:
    metrics: dict[str, float]
    batch: RolloutBatch                     # the batch with every derived field
    timing: dict[str, float] = field(default_factory=dict)


def needs_ref(cfg: Config) -> bool:
    return cfg.actor.use_kl_loss or cfg.algorithm.use_kl_in_reward


def sequence_scores(batch: RolloutBatch, cfg: Config) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Rule score plus the DAPO overlong penalty when enabled: ([B] scores, [B] penalty or None)."""
    if "scores" not in batch:
        raise InputError("the batch has no `scores` (rule reward per trajectory)", key="scores")
    scores = batch["scores"].double()
    ob = cfg.reward.overlong_buffer
    if not ob.enable:
        return scores, None
    penalty = overlong_penalty(batch["response_lengths"], max_response_length=cfg.rollout.response_length,
                               buffer_len=ob.len, penalty_factor=ob.penalty_factor).double()
    return scores + penalty, penalty


def select_groups(batch: RolloutBatch, cfg: Config) -> tuple[RolloutBatch, int]:
    """DAPO dynamic sampling on one batch: keep the prompt groups whose filter metric has a
    non-zero spread, and single-row groups. Returns (kept rows, number of kept groups).

    The metric (algorithm.filter_groups.metric): ``acc``/``score`` = the rule score;
    ``seq_reward`` = score + overlong penalty; ``seq_final_reward`` = the same, because the filter
    runs before old/reference log-probs exist (as in verl's DAPO recipe), so KL-in-reward cannot
    have been applied yet."""
    if not cfg.algorithm.filter_groups.enable:
        return batch, int(torch.unique(batch["uid"]).numel())
    keep = filter_groups(batch["uid"], filter_metric(batch, cfg))
    kept = batch.select(keep.nonzero().flatten())
    return kept, int(torch.unique(kept["uid"]).numel()) if len(kept) else 0


def filter_metric(batch: RolloutBatch, cfg: Config) -> torch.Tensor:
    """[B] float64: the per-trajectory value DAPO's group filter reads
    (``algorithm.filter_groups.metric``; see :func:`select_groups`)."""
    if cfg.algorithm.filter_groups.metric in RAW_SCORE_METRICS:
        return batch["scores"].double()
    return sequence_scores(batch, cfg)[0]


def prepare_batch(roles: Roles, batch: RolloutBatch, cfg: Config) -> tuple[RolloutBatch, dict]:
    """Derive every field the updates need. Returns the new batch and batch-level metrics."""
    metrics: dict[str, float] = {}
    mask = batch.mask
    scores, penalty = sequence_scores(batch, cfg)
    if penalty is not None:
        metrics["train/overlong_penalty_mean"] = float(penalty.mean())
    fdtype = _float_dtype(batch, cfg)
    token_scores = place_scores(scores.to(fdtype), batch["response_lengths"], batch.response_width)
    new = {"token_level_scores": token_scores}

    old_lp, _ = compute_log_probs(roles.actor, batch, cfg, calc_entropy=False)
    new["old_log_probs"] = old_lp.to(fdtype)
    if needs_ref(cfg):
        if roles.ref is not None:
            ref_lp, _ = compute_log_probs(roles.ref, batch, cfg, calc_entropy=False)
            new["ref_log_probs"] = ref_lp.to(fdtype)
        elif "ref_log_probs" not in batch:
            raise InputError("KL is enabled but there is no reference model and the batch has no "
                             "ref_log_probs", key="ref_log_probs")
    if cfg.use_critic:
        if roles.critic is None:
            raise InputError("adv_estimator gae needs a critic", key="algorithm.adv_estimator")
        new["values"] = compute_values(roles.critic, batch, cfg).to(fdtype)
    batch = batch.with_fields(**new)

    if cfg.algorithm.use_kl_in_reward:
        rewards, kl = apply_kl_in_reward(batch["token_level_scores"], batch["old_log_probs"],
                                         batch["ref_log_probs"], mask,
                                         kl_coef=cfg.algorithm.kl_coef,
                                         kl_penalty=cfg.algorithm.kl_penalty,
                                         k3_clamp=cfg.algorithm.k3_clamp)
        batch = batch.with_fields(token_level_rewards=rewards, kl=kl)
        metrics["actor/reward_kl_penalty"] = float(cfg.algorithm.kl_coef * masked_mean(kl, mask))
    else:
        batch = batch.with_fields(token_level_rewards=batch["token_level_scores"])

    rc = cfg.actor.rollout_correction
    if "rollout_log_probs" in batch:
        metrics.update(mismatch_metrics(batch["old_log_probs"], batch["rollout_log_probs"], mask))
    if rc.rollout_is is not None:
        if "rollout_log_probs" not in batch:
            raise InputError("actor.rollout_correction.rollout_is needs rollout_log_probs in the "
                             "rollout", key="rollout_log_probs")
        weights, truncated = rollout_is_weights(batch["old_log_probs"], batch["rollout_log_probs"],
                                                mask, level=rc.rollout_is,
                                                threshold=rc.rollout_is_threshold,
                                                mode=rc.rollout_is_mode,
                                                threshold_lower=rc.rollout_is_threshold_lower)
        batch = batch.with_fields(rollout_is_weights=weights)
        metrics.update(is_metrics(weights, truncated, mask, level=rc.rollout_is))

    adv, ret = compute_advantages(cfg.algorithm.adv_estimator,
                                  token_level_rewards=batch["token_level_rewards"],
                                  response_mask=mask, uid=batch["uid"], values=batch.get("values"),
                                  gamma=cfg.algorithm.gamma, lam=cfg.algorithm.lam,
                                  norm_adv_by_std_in_grpo=cfg.algorithm.norm_adv_by_std_in_grpo,
                                  outcome_score=cfg.algorithm.outcome_score,
                                  grpo_std_eps=cfg.algorithm.grpo_std_eps)
    batch = batch.with_fields(advantages=adv, returns=ret)
    return batch, metrics


def data_metrics(batch: RolloutBatch, cfg: Config) -> dict[str, float]:
    """Batch statistics (verl's compute_data_metrics), read at the end of the step so that a stage
    that mutated a stored tensor in place shows up here (slime PR #2114)."""
    mask = batch.mask
    seq_scores = batch["token_level_scores"].sum(1)
    seq_rewards = batch["token_level_rewards"].sum(1)
    rl = batch["response_lengths"].double()
    adv = batch["advantages"][mask]
    m = {
        "critic/score/mean": float(seq_scores.mean()),
        "critic/score/max": float(seq_scores.max()),
        "critic/score/min": float(seq_scores.min()),
        "critic/rewards/mean": float(seq_rewards.mean()),
        "critic/advantages/mean": float(masked_mean(batch["advantages"], mask)),
        "critic/advantages/max": float(adv.max()) if adv.numel() else 0.0,
        "critic/advantages/min": float(adv.min()) if adv.numel() else 0.0,
        "critic/returns/mean": float(masked_mean(batch["returns"], mask)),
        "response_length/mean": float(rl.mean()),
        "response_length/max": float(rl.max()),
        "response_length/min": float(rl.min()),
        "response_length/clip_ratio": float((rl >= cfg.rollout.response_length).double().mean()),
        "prompt_length/mean": float(batch["prompt_lengths"].double().mean()),
    }
    if "values" in batch and cfg.use_critic:
        m["critic/values/mean"] = float(masked_mean(batch["values"], mask))
    if "kl" in batch:
        m["rollout/kl"] = float(masked_mean(batch["kl"], mask))
    m.update(reward_function_metrics(batch))
    return m


def reward_function_metrics(batch: RolloutBatch) -> dict[str, float]:
    """With several reward functions (rlaudit/data/rewards.py): each one's mean score over the
    rows it scored, as TRL logs ``rewards/<func>/mean`` (a function that scored none of the
    batch's rows is not logged: its mean has no denominator)."""
    funcs = reward_functions(batch.tensors, batch.meta)
    if funcs is None:
        return {}
    means = reward_function_means(batch[SCORES], batch.get(MASK))
    return {funcs.metric(f): v for f, v in enumerate(means) if math.isfinite(v)}


def train_step(roles: Roles, batch: RolloutBatch, cfg: Config) -> StepResult:
    """prepare -> critic update -> actor update. Metrics use catalogue names only."""
    t0 = time.perf_counter()
    batch, metrics = prepare_batch(roles, batch, cfg)
    timing = {}
    if cfg.use_critic:
        t = time.perf_counter()
        metrics.update(update_critic(roles.critic, batch, cfg))
        timing["timing/update_critic"] = time.perf_counter() - t
    t = time.perf_counter()
    metrics.update(update_actor(roles.actor, batch, cfg))
    timing["timing/update_actor"] = time.perf_counter() - t
    metrics.update(data_metrics(batch, cfg))
    timing["timing/step"] = time.perf_counter() - t0
    return StepResult(metrics=metrics, batch=batch, timing=timing)


def _float_dtype(batch: RolloutBatch, cfg: Config) -> torch.dtype:
    """Per-token float fields are kept in the compute dtype (float64 runs stay float64)."""
    return torch.float64 if cfg.trainer.dtype == "float64" else torch.float32
