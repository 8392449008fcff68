"""Deliberately broken adapters: each has ONE bug of the kind RL trainers ship (SEEDS.md and its
generalisations). tests/targets/test_*.py assert each is caught by the expected check.

Stage-level ones subclass the reference adapter (correct everywhere but the bug); train_step ones
swap ToyTrainer for a subclass with one changed policy.
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch

from examples.toy_trainer import trainer as toy
from examples.toy_trainer.adapter import ToyAdapter
from rlaudit.algo.kl import kl_penalty as kl_estimate
from rlaudit.algo.policy_loss import compute_policy_loss
from rlaudit.data.batching import (is_padding_microbatch, pad_microbatch_list,
                                   plan_microbatches_by_tokens, shard_for_dp, take)
from rlaudit.targets.contract.own_adapters import ReferenceAdapter


# ---- stage-level -------------------------------------------------------------------------------

class RewardsAliasScores(ReferenceAdapter):
    """Adds the KL penalty into the caller's ``token_level_scores`` tensor and returns it as the
    rewards: the scores the caller keeps are overwritten (an input mutated and aliased)."""

    name = "rewards-alias-scores"

    def apply_kl_in_reward(self, *, token_level_scores, old_log_probs, ref_log_probs,
                           response_mask, kl_coef, kl_penalty):
        kl = kl_estimate(old_log_probs, ref_log_probs, kl_penalty) * response_mask
        token_level_scores -= kl_coef * kl
        return token_level_scores, kl


class StoredKLInPlace(ReferenceAdapter):
    """slime PR #2114: the reward is built in place in the tensor that is stored (and logged as
    rollout/kl): ``k = kl; k *= -coef; k += scores``."""

    name = "kl-in-place"

    def apply_kl_in_reward(self, *, token_level_scores, old_log_probs, ref_log_probs,
                           response_mask, kl_coef, kl_penalty):
        kl = kl_estimate(old_log_probs, ref_log_probs, kl_penalty) * response_mask
        rewards = kl                        # the bug: an alias, not a copy
        rewards *= -kl_coef
        rewards += token_level_scores
        return rewards, kl


class PerMicroBatchNorm(ReferenceAdapter):
    """Loss normalised by the micro-batch's own token/sequence counts: the global denominators
    are accepted and ignored."""

    name = "per-micro-norm"

    def agg_loss(self, *, loss_mat, mask, mode, denominators=None):
        return super().agg_loss(loss_mat=loss_mat, mask=mask, mode=mode)

    def policy_loss(self, *, denominators=None, **kw):
        return super().policy_loss(**kw)


class IgnoresClipHigh(ReferenceAdapter):
    """An ignored config flag: ``clip_ratio_high`` is dropped, the lower epsilon used for both."""

    name = "ignores-clip-high"

    def policy_loss(self, *, clip_ratio_low, clip_ratio_high, **kw):
        return super().policy_loss(clip_ratio_low=clip_ratio_low, clip_ratio_high=clip_ratio_low,
                                   **kw)


class HardCodedPaddingKeys(ReferenceAdapter):
    """SkyRL PR #1811: padding micro-batches built from a hard-coded key list, so optional fields
    (rollout_log_probs, ...) are missing on them."""

    name = "hard-coded-padding-keys"
    KEYS = ("prompt_ids", "prompt_lengths", "response_ids", "response_lengths", "response_mask",
            "uid", "old_log_probs", "advantages")

    def make_microbatches(self, batch, **kw):
        ranks = super().make_microbatches(batch, **kw)
        return [[mb.without(*[k for k in mb.keys() if k not in self.KEYS])
                 if is_padding_microbatch(mb) else mb for mb in rank] for rank in ranks]


class NoPaddingMicrobatches(ReferenceAdapter):
    """Ranks keep however many micro-batches their shard needs (no padding micro-batches)."""

    name = "no-padding"

    def make_microbatches(self, batch, **kw):
        return [[mb for mb in rank if not is_padding_microbatch(mb)]
                for rank in super().make_microbatches(batch, **kw)]


class DropsLastRow(ReferenceAdapter):
    """An off-by-one: the last row of every rank's last micro-batch is lost."""

    name = "drops-last-row"

    def make_microbatches(self, batch, **kw):
        ranks = super().make_microbatches(batch, **kw)
        out = []
        for rank in ranks:
            real = [i for i, mb in enumerate(rank) if not is_padding_microbatch(mb)]
            last = real[-1]
            rank = list(rank)
            rank[last] = rank[last].select(range(len(rank[last]) - 1))
            out.append(rank)
        return out


class NestedIndexingDistill(ReferenceAdapter):
    """verl PR #5997: the distillation loss selects valid tokens with boolean indexing, which
    works on padded tensors and fails on nested (jagged) ones."""

    name = "nested-indexing-distill"

    def distill_loss(self, *, name, student, teacher, mask=None):
        m = (torch.ones(student.shape[:2], dtype=torch.bool) if mask is None else mask.bool())
        s, t = student[m], teacher[m]                       # the bug: fails on nested input
        if name == "forward_kl_topk":
            vals = (t.exp() * (t - s)).sum(-1)
        else:
            vals = kl_estimate(s, t, "k3")
        out = torch.zeros(m.shape, dtype=student.dtype)
        return out.masked_scatter(m, vals)


class GroupsByPosition(ReferenceAdapter):
    """Advantages grouped by row position (rows i*n .. i*n+n-1 form a group) instead of uid."""

    name = "groups-by-position"

    def compute_advantages(self, *, uid, **kw):
        n = max(len(uid) // max(int(uid.unique().numel()), 1), 1)
        return super().compute_advantages(uid=torch.arange(len(uid)) // n, **kw)


class ZeroSpreadAsSingleton(ReferenceAdapter):
    """GRPO: a group whose rewards do not vary goes down the one-row path (mean 0, std 1), so
    its rows get their raw scores as advantages instead of 0 (the sixth blind audit's)."""

    name = "zero-spread-as-singleton"

    def compute_advantages(self, *, estimator, token_level_rewards, response_mask, uid, **kw):
        adv, ret = super().compute_advantages(
            estimator=estimator, token_level_rewards=token_level_rewards,
            response_mask=response_mask, uid=uid, **kw)
        if estimator != "grpo":
            return adv, ret
        score = (token_level_rewards * response_mask).sum(-1)
        flat = torch.tensor([bool((score[uid == u] == score[uid == u][0]).all())
                             and int((uid == u).sum()) > 1 for u in uid.tolist()])
        raw = score.unsqueeze(-1) * response_mask
        adv = torch.where(flat.unsqueeze(-1), raw, adv)
        return adv, adv.clone()


class UidsIn32Bits(ReferenceAdapter):
    """Group ids packed into int32 (for an all-gather) before grouping: ids equal modulo 2**32
    merge their groups (the sixth blind audit's)."""

    name = "uids-in-32-bits"

    def compute_advantages(self, *, uid, **kw):
        return super().compute_advantages(uid=uid.to(torch.int32).to(torch.int64), **kw)


class NoKLWhenCoefZero(ReferenceAdapter):
    """KL in reward with a coefficient of 0: the stored KL (logged as rollout/kl) is zeros
    instead of the KL (verl #6016's kind; the sixth blind audit's)."""

    name = "no-kl-when-coef-zero"

    def apply_kl_in_reward(self, *, token_level_scores, old_log_probs, ref_log_probs,
                           response_mask, kl_coef, kl_penalty):
        rewards, kl = super().apply_kl_in_reward(
            token_level_scores=token_level_scores, old_log_probs=old_log_probs,
            ref_log_probs=ref_log_probs, response_mask=response_mask, kl_coef=kl_coef,
            kl_penalty=kl_penalty)
        return (rewards, torch.zeros_like(kl)) if kl_coef == 0 else (rewards, kl)


class NormLenFromWidth(ReferenceAdapter):
    """seq-mean-token-sum-norm divided by the micro-batch's own padded width instead of the
    whole batch's ``denominators.norm_len`` (the sixth blind audit's)."""

    name = "norm-len-from-width"

    def agg_loss(self, *, loss_mat, mask, mode, denominators=None):
        if mode == "seq-mean-token-sum-norm" and denominators is not None:
            denominators = dataclasses.replace(denominators, norm_len=float(mask.shape[-1]))
        return super().agg_loss(loss_mat=loss_mat, mask=mask, mode=mode,
                                denominators=denominators)


class MaskedValuesLeak(ReferenceAdapter):
    """token-mean written as ``loss.sum() / mask.sum()``: per-token losses on masked positions
    leak into the result (harmless only while those positions happen to hold zeros)."""

    name = "masked-values-leak"
    loss_agg_modes = ("token-mean",)
    loss_modes = ("vanilla",)

    def policy_loss(self, *, old_log_prob, log_prob, advantages, response_mask, loss_mode,
                    loss_agg_mode, clip_ratio_low, clip_ratio_high, clip_ratio_c,
                    denominators=None):
        everything = torch.ones_like(response_mask, dtype=torch.bool)
        pol = compute_policy_loss(loss_mode, old_log_prob=old_log_prob, log_prob=log_prob,
                                  advantages=advantages, mask=everything,
                                  clip_ratio_low=clip_ratio_low, clip_ratio_high=clip_ratio_high,
                                  clip_ratio_c=clip_ratio_c)
        tokens = denominators.tokens if denominators is not None else float(response_mask.sum())
        return pol.loss_mat.sum() / max(tokens, 1.0), {}


class MutatesRewards(ReferenceAdapter):
    """Zeroes masked rewards in place on the caller's tensor (``rewards.mul_(mask)``)."""

    name = "mutates-rewards"

    def compute_advantages(self, *, token_level_rewards, response_mask, **kw):
        token_level_rewards.mul_(response_mask)
        return super().compute_advantages(token_level_rewards=token_level_rewards,
                                          response_mask=response_mask, **kw)


class AliasedAdvantagesReturns(ReferenceAdapter):
    """Returns the same tensor as advantages and returns, as verl does for outcome estimators.
    Not a bug by itself (the caller's inputs are safe): a note, not a failure."""

    name = "aliased-outputs"
    #: outcome estimators, whose returns equal their advantages (so only the aliasing is wrong)
    advantage_estimators = ("grpo", "drgrpo", "rloo", "reinforce_plus_plus_baseline")

    def compute_advantages(self, **kw):
        adv, _ = super().compute_advantages(**kw)
        return adv, adv


class MetricsViewBuffer(ReferenceAdapter):
    """Metrics returned as views of a buffer that the next call overwrites in place."""

    name = "metrics-view-buffer"

    def __init__(self):
        self._buf = torch.zeros(8, dtype=torch.float64)

    def policy_loss(self, **kw):
        loss, metrics = super().policy_loss(**kw)
        self._buf.zero_()
        names = sorted(metrics)
        for i, name in enumerate(names):
            self._buf[i] = metrics[name].detach()
        return loss, {name: self._buf[i] for i, name in enumerate(names)}


class NaNAdvantages(ReferenceAdapter):
    """NaN on the first valid token (a division by a zero count somewhere)."""

    name = "nan-advantages"

    def compute_advantages(self, **kw):
        adv, ret = super().compute_advantages(**kw)
        adv = adv.clone()
        valid = kw["response_mask"].nonzero()
        if len(valid):
            adv[tuple(valid[0])] = float("nan")
        return adv, ret


class FilterDropsSingletons(ReferenceAdapter):
    """DAPO's group filter without its ``or len(group) == 1`` clause: a one-row group has std 0,
    so it is dropped (verl's recipe keeps it)."""

    name = "filter-drops-singletons"

    def filter_groups(self, *, batch, metric):
        uid = batch["uid"]
        keep = [i for i in range(len(uid))
                if len({float(metric[j]) for j in (uid == uid[i]).nonzero().flatten()}) > 1]
        return batch.select(keep)


# ---- train_step (ToyTrainer with one changed policy) -------------------------------------------

class _EntropyOnlyInLoss(toy.ToyTrainer):
    def wants_entropy(self):                 # verl PR #6016: calculate_entropy ignored
        return self.cfg.entropy_coeff != 0


class _PostClipGradNorm(toy.ToyTrainer):
    def clip_gradients(self):                # the norm is measured after clipping
        max_norm = self.cfg.grad_clip if self.cfg.grad_clip > 0 else float("inf")
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)
        return float(torch.nn.utils.get_total_norm(
            [p.grad for p in self.model.parameters() if p.grad is not None]))


class _ClipsEachMicroBatch(toy.ToyTrainer):
    """Gradient clipping inside the micro-batch loop: each backward's accumulated gradient is
    clipped, and the last clip's norm is logged (a seventh blind audit's bug #1)."""

    def micro_step(self, mb, counts, with_entropy):
        stats = super().micro_step(mb, counts, with_entropy)
        self._last_norm = toy.ToyTrainer.clip_gradients(self)
        return stats

    def clip_gradients(self):
        return self._last_norm


class _IgnoresClipC(toy.ToyTrainer):
    """The dual-clip bound left at the trainer's own default (3.0) whatever the config says:
    glue that drops ``clip_ratio_c`` (a seventh blind audit's miss)."""

    def __init__(self, model, cfg, ref_model=None):
        super().__init__(model, dataclasses.replace(cfg, clip_c=3.0), ref_model)


class _IgnoresPenaltyFactor(toy.ToyTrainer):
    """DAPO's overlong penalty factor left at the trainer's own default (1.0): glue that drops
    ``penalty_factor`` (a seventh blind audit's miss)."""

    def __init__(self, model, cfg, ref_model=None):
        super().__init__(model, dataclasses.replace(cfg, overlong_penalty_factor=1.0),
                         ref_model)


class _AdvantagesPerMiniBatch(toy.ToyTrainer):
    """GRPO advantages computed over each mini-batch's rows, as a trainer that computes them
    after cutting (or per data-parallel shard) does: right only where a mini-batch holds whole
    groups (a seventh blind audit's bug #11)."""

    def update(self, data):
        k, n = self.cfg.mini_batch_rows, len(data["index"])
        rewards, mask, index = (data["token_level_rewards"], data["response_mask"],
                                data["index"])
        data["advantages"] = torch.cat([
            toy.grpo_advantages(rewards[i:i + k], mask[i:i + k], index[i:i + k],
                                self.cfg.norm_adv_by_std) for i in range(0, n, k)])
        return super().update(data)


class _PerMicroMean(toy.ToyTrainer):
    def normaliser(self, mini_counts, micro, num_micros):
        """Mean per micro-batch, then averaged over micro-batches (gradient accumulation)."""
        local = toy.counts_of(micro, mini_counts["norm_len"])
        return {"tokens": local["tokens"] * num_micros, "seqs": local["seqs"] * num_micros,
                "norm_len": mini_counts["norm_len"]}


class _MetricsInReusedBuffer(toy.ToyTrainer):
    def step(self, data):                    # metrics are views of a buffer the next step reuses
        metrics, derived = super().step(data)
        names = sorted(metrics)
        if not hasattr(self, "_buf"):
            self._buf = torch.zeros(len(names), dtype=torch.float64)
        for i, name in enumerate(names):
            self._buf[i] = float(metrics[name])
        return {name: self._buf[i] for i, name in enumerate(names)}, derived


class _IgnoresAggMode(toy.ToyTrainer):
    def __init__(self, model, cfg, ref_model=None):
        cfg.loss_agg_mode = "token-mean"       # loss_agg_mode from the config is dropped
        super().__init__(model, cfg, ref_model)


class _IgnoresLossScaleFactor(toy.ToyTrainer):
    def __init__(self, model, cfg, ref_model=None):
        cfg.norm_len = None                    # loss_scale_factor dropped: the padded width
        super().__init__(model, cfg, ref_model)


class _IgnoresTemperature(toy.ToyTrainer):
    def __init__(self, model, cfg, ref_model=None):
        cfg.temperature = 1.0                  # log-probs of the raw logits, not logits / T
        super().__init__(model, cfg, ref_model)


class _ScoreOnLastTrainedToken(toy.ToyTrainer):
    def last_token(self, data):              # counts loss-mask tokens: wrong with masked holes
        n = data["response_mask"].sum(-1, keepdim=True).long()
        return torch.arange(data["responses"].shape[1]).unsqueeze(0) == n - 1


class _IgnoresEpochs(toy.ToyTrainer):
    def __init__(self, model, cfg, ref_model=None):
        cfg.epochs = 1                         # ppo_epochs from the config is dropped
        super().__init__(model, cfg, ref_model)


class _RefFromActor(toy.ToyTrainer):
    def __init__(self, model, cfg, ref_model=None):
        super().__init__(model, cfg, model)    # the reference policy is the live actor


class _ClampsScoresInPlace(toy.ToyTrainer):
    def step(self, data):
        data["scores"].clamp_(-10.0, 10.0)   # writes into the caller's batch
        return super().step(data)


class _FilterRetakesScores(toy.ToyTrainer):
    @staticmethod
    def filter_groups(data, metric):     # DAPO filter, then scores re-taken from the unfiltered
        kept = toy.ToyTrainer.filter_groups(data, metric)       # batch: rows misaligned
        return {**kept, "scores": data["scores"][:len(kept["index"])]}


class _FilterRetakesMetricColumn(toy.ToyTrainer):
    @staticmethod
    def filter_groups(data, metric):     # the metric kept as a batch column (verl's recipe keeps
        data = {**data, "seq_final_reward": metric}     # it under its name), the DAPO filter,
        kept = toy.ToyTrainer.filter_groups(data, metric)   # then the column re-taken unfiltered
        return {**kept, "seq_final_reward": data["seq_final_reward"][:len(kept["index"])]}


class _SequenceISFromMeanLogRatio(toy.ToyTrainer):
    def importance_weights(self, data):      # "sequence" weight from the mean log-ratio
        if self.cfg.rollout_is != "sequence":
            return super().importance_weights(data)
        mask = data["response_mask"]
        log_ratio = (data["old_log_probs"] - data["rollout_log_probs"]) * mask
        row = log_ratio.sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1)
        w = torch.exp(row.clamp(-20, 20)).clamp(max=self.cfg.rollout_is_threshold)
        return w.expand_as(log_ratio) * mask


class _TokenISInverted(toy.ToyTrainer):
    def importance_weights(self, data):      # exp(rollout - old): the ratio upside down
        return super().importance_weights({**data, "old_log_probs": data["rollout_log_probs"],
                                           "rollout_log_probs": data["old_log_probs"]})


class _SequenceISPerToken(toy.ToyTrainer):
    def importance_weights(self, data):      # "sequence" computed with token ratios
        if self.cfg.rollout_is == "sequence":
            self.cfg.rollout_is = "token"
            try:
                return super().importance_weights(data)
            finally:
                self.cfg.rollout_is = "sequence"
        return super().importance_weights(data)


class _PenaltyInEveryFilterMetric(toy.ToyTrainer):
    def step(self, data):               # the filter adds the overlong penalty to any metric
        with _config_set(self.cfg, filter_metric="seq_reward"):
            return super().step(data)


class _KLLossSignFlipped(toy.ToyTrainer):
    def with_kl_penalty(self, loss, kl):     # the KL term subtracted: pushes away from the ref
        return loss - self.cfg.kl_loss_coef * kl


@contextlib.contextmanager
def _config_set(cfg, **values):
    """``cfg``'s fields set to ``values`` for the block (the toy's loss without one term)."""
    before = {k: getattr(cfg, k) for k in values}
    for k, v in values.items():
        setattr(cfg, k, v)
    try:
        yield
    finally:
        for k, v in before.items():
            setattr(cfg, k, v)


def _agg(counts) -> dict:
    """The toy's aggregation arguments for a micro-batch's ``counts``."""
    return dict(num_tokens=counts["tokens"], num_seqs=counts["seqs"],
                norm_len=counts["norm_len"], row_tokens=counts.get("row_tokens"))


class _EntropyBonusAsTokenMean(toy.ToyTrainer):
    """The entropy bonus added as a token mean whatever ``loss_agg_mode`` says (the logged
    entropy stays aggregated like the loss): right under token-mean only (a blind audit,
    2026-11-27: passed --all while every entropy bonus of the scenarios was token-mean)."""

    def loss_terms(self, mb, logp, ent, mask, counts, with_entropy):
        coeff = self.cfg.entropy_coeff
        with _config_set(self.cfg, entropy_coeff=0.0):
            loss, stats = super().loss_terms(mb, logp, ent, mask, counts, with_entropy)
        if with_entropy and coeff != 0:
            loss = loss - coeff * toy.aggregate(ent, mask, "token-mean", **_agg(counts))
            stats["loss"] = loss.detach()
        return loss, stats


class _KLWeightedByRolloutIS(toy.ToyTrainer):
    """The KL loss multiplied by the rollout IS weights too (verl weights the policy loss
    alone): the same wherever the weights are 1 or there is no KL loss (a blind audit,
    2026-11-27: passed --all until rollout_is_stale carried a KL loss)."""

    def loss_terms(self, mb, logp, ent, mask, counts, with_entropy):
        w = mb.get("rollout_is_weights")
        if w is None or not self.cfg.use_kl_loss:
            return super().loss_terms(mb, logp, ent, mask, counts, with_entropy)
        with _config_set(self.cfg, use_kl_loss=False):
            loss, stats = super().loss_terms(mb, logp, ent, mask, counts, with_entropy)
        ref = torch.where(mask > 0, mb["ref_log_probs"], logp.detach())
        kl = toy.aggregate(toy.kl_penalty(logp, ref, self.cfg.kl_loss_type) * w, mask,
                           self.cfg.loss_agg_mode, **_agg(counts))
        stats["kl_loss"] = kl.detach()
        loss = self.with_kl_penalty(loss, kl)
        stats["loss"] = loss.detach()
        return loss, stats


class _NoPaddingMicros(toy.ToyTrainer):
    def __init__(self, model, cfg, ref_model=None):
        cfg.padding_micros = 0                 # the padding path does not exist
        super().__init__(model, cfg, ref_model)


class _CPMetricsReducedTwice(toy.ToyTrainer):
    def cp_all_reduce_metric(self, partial_values):  # all-reduced over the CP group, then again
        return super().cp_all_reduce_metric(partial_values) * self.cfg.cp_size


class _CPLossScaledBySize(toy.ToyTrainer):
    def cp_all_reduce(self, partial_losses):
        # Megatron-LM's `loss * cp_size` (for gradients averaged over DP x CP ranks) kept although
        # the CP group sums its gradients: every gradient is cp times too large
        return super().cp_all_reduce(partial_losses) * self.cfg.cp_size


def toy_with(trainer_class, name: str) -> type:
    """A ToyAdapter subclass that runs ``trainer_class``."""
    return type(f"Toy_{name}", (ToyAdapter,), {"trainer_class": trainer_class, "name": name})


EntropyNotLogged = toy_with(_EntropyOnlyInLoss, "entropy-not-logged")
GradNormAfterClip = toy_with(_PostClipGradNorm, "grad-norm-after-clip")
PerMicroMeanTrainer = toy_with(_PerMicroMean, "per-micro-mean")
ClipsEachMicroBatch = toy_with(_ClipsEachMicroBatch, "clips-each-micro-batch")
IgnoresClipC = toy_with(_IgnoresClipC, "ignores-clip-ratio-c")
AdvantagesPerMiniBatch = toy_with(_AdvantagesPerMiniBatch, "advantages-per-mini-batch")
IgnoresPenaltyFactor = toy_with(_IgnoresPenaltyFactor, "ignores-penalty-factor")
MetricsReusedBuffer = toy_with(_MetricsInReusedBuffer, "metrics-reused-buffer")
IgnoresAggModeTrainer = toy_with(_IgnoresAggMode, "ignores-agg-mode")
EntropyBonusAsTokenMean = toy_with(_EntropyBonusAsTokenMean, "entropy-bonus-as-token-mean")
IgnoresLossScaleFactor = toy_with(_IgnoresLossScaleFactor, "ignores-loss-scale-factor")
KLWeightedByRolloutIS = toy_with(_KLWeightedByRolloutIS, "kl-weighted-by-rollout-is")
MutatesInputBatch = toy_with(_ClampsScoresInPlace, "mutates-input-batch")
IgnoresTemperature = toy_with(_IgnoresTemperature, "ignores-temperature")
ScoreOnLastTrainedToken = toy_with(_ScoreOnLastTrainedToken, "score-on-last-trained-token")
IgnoresEpochs = toy_with(_IgnoresEpochs, "ignores-ppo-epochs")
RefFromActor = toy_with(_RefFromActor, "ref-from-actor")
FilterMisalignsScores = toy_with(_FilterRetakesScores, "filter-misaligns-scores")
FilterRetakesMetric = toy_with(_FilterRetakesMetricColumn, "filter-retakes-metric")
PenaltyInEveryFilterMetric = toy_with(_PenaltyInEveryFilterMetric,
                                      "penalty-in-every-filter-metric")
KLLossSignFlipped = toy_with(_KLLossSignFlipped, "kl-loss-sign-flipped")
CPMetricsReducedTwice = toy_with(_CPMetricsReducedTwice, "cp-metrics-reduced-twice")
CPLossScaledBySize = toy_with(_CPLossScaledBySize, "cp-loss-scaled-by-size")
SequenceISFromMean = toy_with(_SequenceISFromMeanLogRatio, "sequence-is-from-mean")
SequenceISPerToken = toy_with(_SequenceISPerToken, "sequence-is-per-token")


class TokenISOnly(ToyAdapter):
    """A correct trainer whose rollout importance sampling has the token level only."""

    name = "token-is-only"

    def supports(self, config):
        ok, why = super().supports(config)
        level = config.actor.rollout_correction.rollout_is
        if level in ("sequence", "geometric"):
            return False, ", ".join(filter(None, [why, f"rollout_is {level}"]))
        return ok, why


class TokenISInverted(TokenISOnly):
    """Token-level IS only, with the ratio inverted: exp(rollout - old) instead of
    exp(old - rollout)."""

    name = "token-is-inverted"
    trainer_class = _TokenISInverted


class NoPaddingToy(ToyAdapter):
    """A trainer without a padding path: its cutter leaves each rank with the micro-batches its
    shard needs, its training step never runs a padding micro-batch."""

    name = "no-padding-toy"
    trainer_class = _NoPaddingMicros

    def make_microbatches(self, batch, **kw):
        return [[mb for mb in rank if not bool((mb["uid"] == -1).all())]   # toy padding: uid -1
                for rank in super().make_microbatches(batch, **kw)]


class MetricsOnly(ToyAdapter):
    """A correct trainer whose adapter returns metrics only (no tensors, parameters or
    micro-batches): invariants that need those are n/a, never passed."""

    name = "metrics-only"

    def train_step(self, **kw):
        out = super().train_step(**kw)
        return type(out)(metrics=out.metrics)


class OnlyAdvantages:
    """A third-party adapter with a single stage and no base class."""

    name = "only-advantages"

    def compute_advantages(self, **kw):
        return ReferenceAdapter().compute_advantages(**kw)



class BudgetWithoutPrompt(ReferenceAdapter):
    """A token-budget cutter that counts only response tokens against ``max_token_len`` (the
    prompt left out), so its micro-batches hold more than the budget (a sixth blind audit's
    miss)."""

    name = "budget-without-prompt"

    def make_microbatches(self, batch, *, dp_size, micro_batch_size=None, max_token_len=None,
                          extra_padding=0):
        if max_token_len is None:
            return super().make_microbatches(batch, dp_size=dp_size,
                                             micro_batch_size=micro_batch_size,
                                             extra_padding=extra_padding)
        shards = shard_for_dp(batch, dp_size)
        per_rank = [take(s, plan_microbatches_by_tokens(s["response_lengths"], max_token_len))
                    for s in shards]
        target = max(len(m) for m in per_rank) + extra_padding
        return [pad_microbatch_list(m, target, s) for m, s in zip(per_rank, shards)]


class _NoOverlongPenalty(toy.ToyTrainer):
    def overlong_penalty(self, data):        # DAPO's overlong penalty never applied
        return torch.zeros(data["responses"].shape[0], dtype=torch.float64)


NoOverlongPenalty = toy_with(_NoOverlongPenalty, "no-overlong-penalty")


class K3WithoutClamps(ReferenceAdapter):
    """k3 as ``e^d - d - 1`` of ``d = ref - logp`` with neither of its clamps (the value at 10,
    the log-ratio at +-20): a blind audit's bug caught by backend-parity alone until a stage case
    put log-ratios past the clamps."""

    name = "k3-without-clamps"

    def kl_penalty(self, *, log_prob, ref_log_prob, kind):
        if kind in ("k3", "low_var_kl", "k3+", "low_var_kl+"):
            d = ref_log_prob - log_prob
            value = torch.exp(d) - d - 1
            if kind.endswith("+"):
                k2 = 0.5 * (log_prob - ref_log_prob).square()
                return value.detach() + (k2 - k2.detach())
            return value
        return super().kl_penalty(log_prob=log_prob, ref_log_prob=ref_log_prob, kind=kind)
