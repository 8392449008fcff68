"""The rlaudit adapter for ToyTrainer: the worked example of docs/targets.md.

    rlaudit run --target examples.toy_trainer.adapter:ToyAdapter

An adapter translates, nothing more: rlaudit's batch (response-aligned ``[B, R]`` tensors,
``uid`` ints) into the trainer's format (verl-like left-padded ``input_ids``, string ``index``),
calls the trainer's own functions, and translates the results back (rlaudit field names, metric
names from rlaudit/metrics.py). Each stage method below is optional; what is left out is
reported n/a. ToyTrainer has no distillation loss, so ``distill_loss`` is not defined here.
"""

from __future__ import annotations

import copy
import functools

import torch

from examples.toy_trainer import trainer as toy
from rlaudit.targets import TargetAdapter, TrainStepOutput

#: ToyTrainer's metric names -> rlaudit's catalogue names
METRICS = {"pg_loss": "actor/pg_loss", "pg_clipfrac": "actor/pg_clipfrac",
           "pg_clipfrac_lower": "actor/pg_clipfrac_lower", "ppo_kl": "actor/ppo_kl",
           "entropy": "actor/entropy", "kl_loss": "actor/kl_loss", "kl_coef": "actor/kl_coef",
           "loss": "actor/loss", "grad_norm": "actor/grad_norm", "lr": "actor/lr",
           "rollout_kl": "rollout/kl", "score_mean": "critic/score/mean",
           "adv_mean": "critic/advantages/mean", "is_weight_mean": "rollout_corr/is_weight_mean"}
#: ToyTrainer's layout fields, rebuilt by from_toy; every other field passes through unchanged
LAYOUT = ("input_ids", "attention_mask", "position_ids", "responses", "index")
PAD_INDEX = "__pad__"


# ---- format conversion ---------------------------------------------------------------------------

def to_toy(batch) -> dict:
    """rlaudit RolloutBatch -> ToyTrainer dict (left-padded prompt | right-padded response)."""
    t = batch.tensors
    p, pl, rl = batch.prompt_width, t["prompt_lengths"], t["response_lengths"]
    src = torch.arange(p).unsqueeze(0) - (p - pl).unsqueeze(1)      # left-pad: shift right
    in_prompt = src >= 0
    prompt = torch.where(in_prompt, t["prompt_ids"].gather(1, src.clamp(min=0)), 0)
    in_resp = torch.arange(batch.response_width).unsqueeze(0) < rl.unsqueeze(1)
    attention = torch.cat([in_prompt, in_resp], 1).long()
    data = {k: v for k, v in t.items() if k not in ("prompt_ids", "prompt_lengths",
                                                   "response_ids", "response_lengths", "uid",
                                                   "response_mask")}
    data.update(input_ids=torch.cat([prompt, t["response_ids"]], 1), attention_mask=attention,
                position_ids=(attention.cumsum(-1) - 1).clamp(min=0),
                responses=t["response_ids"], response_mask=t["response_mask"].double(),
                index=[str(u) for u in t["uid"].tolist()])
    return data


def from_toy(data: dict) -> dict:
    """ToyTrainer dict -> rlaudit-named tensors (prompt re-aligned to the left)."""
    width = data["responses"].shape[1]
    p = data["input_ids"].shape[1] - width
    attention = data["attention_mask"]
    pl = attention[:, :p].sum(-1)
    src = (torch.arange(p).unsqueeze(0) + (p - pl).unsqueeze(1)).clamp(max=p - 1)
    keep = torch.arange(p).unsqueeze(0) < pl.unsqueeze(1)
    out = {k: v for k, v in data.items() if k not in LAYOUT}
    out.update(prompt_ids=torch.where(keep, data["input_ids"][:, :p].gather(1, src), 0),
               prompt_lengths=pl, response_ids=data["responses"],
               response_lengths=attention[:, p:].sum(-1),
               response_mask=data["response_mask"] > 0,
               uid=torch.tensor([-1 if i == PAD_INDEX else int(i) for i in data["index"]],
                                dtype=torch.int64))
    return out


def toy_config(config, rows: int) -> toy.ToyConfig:
    """rlaudit Config (verl key names) -> ToyConfig."""
    a, alg = config.actor, config.algorithm
    return toy.ToyConfig(
        lr=a.optim.lr, optimizer=a.optim.name, weight_decay=a.optim.weight_decay,
        betas=tuple(a.optim.betas), eps=a.optim.eps,
        clip_low=a.clip_ratio if a.clip_ratio_low is None else a.clip_ratio_low,
        clip_high=a.clip_ratio if a.clip_ratio_high is None else a.clip_ratio_high,
        clip_c=a.clip_ratio_c, loss_agg_mode=a.loss_agg_mode, norm_len=a.loss_scale_factor,
        entropy_coeff=a.entropy_coeff, calculate_entropy=a.calculate_entropy,
        use_kl_loss=a.use_kl_loss, kl_loss_coef=a.kl_loss_coef, kl_loss_type=a.kl_loss_type,
        use_kl_in_reward=alg.use_kl_in_reward, kl_coef=alg.kl_coef, kl_penalty=alg.kl_penalty,
        norm_adv_by_std=alg.norm_adv_by_std_in_grpo,
        mini_batch_rows=min(a.ppo_mini_batch_size * config.rollout.n, rows),
        micro_batch_rows=a.ppo_micro_batch_size_per_gpu,
        max_tokens_per_micro=a.ppo_max_token_len_per_gpu if a.use_dynamic_bsz else None,
        padding_micros=config.trainer.extra_padding_microbatches, epochs=a.ppo_epochs,
        grad_clip=a.grad_clip, temperature=config.rollout.temperature,
        rollout_is=a.rollout_correction.rollout_is,
        rollout_is_threshold=a.rollout_correction.rollout_is_threshold,
        rollout_is_mode=a.rollout_correction.rollout_is_mode,
        rollout_is_threshold_lower=a.rollout_correction.rollout_is_threshold_lower,
        cp_size=a.context_parallel_size)


@functools.lru_cache(maxsize=4)
def _load(path: str, dtype: str):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype),
                                                attn_implementation="eager").eval()


def load_model(path: str, dtype: str):
    """A fresh copy of the snapshot's model (loaded once per process)."""
    return copy.deepcopy(_load(str(path), dtype))


# ---- the adapter ---------------------------------------------------------------------------------

class ToyAdapter(TargetAdapter):
    name = "toy"
    advantage_estimators = ("grpo",)          # what ToyTrainer implements
    kl_estimators = ("kl", "low_var_kl")
    loss_modes = ("vanilla",)
    metric_names = tuple(METRICS.values())    # parity expects these whenever rlaudit logs them
    layout = {"cp": 2}                        # ToyTrainer can split sequences over 2 CP ranks
    trainer_class = toy.ToyTrainer            # tests swap in broken trainers

    def supports(self, config):
        a, alg, rc = config.actor, config.algorithm, config.actor.rollout_correction
        unsupported = {
            f"adv_estimator {alg.adv_estimator}": alg.adv_estimator != "grpo",
            f"loss_mode {a.loss_mode}": a.loss_mode != "vanilla",
            f"kl_loss_type {a.kl_loss_type}": a.use_kl_loss and a.kl_loss_type not in
            self.kl_estimators, f"kl_penalty {alg.kl_penalty}": alg.use_kl_in_reward
            and alg.kl_penalty not in self.kl_estimators,
            "rollout KL loss": rc.use_rollout_kl_loss,
            "distillation": a.distill.enable, "shuffle": a.shuffle,
            "overlong buffer": config.reward.overlong_buffer.enable,
        }
        why = [k for k, bad in unsupported.items() if bad]
        return not why, ", ".join(why)

    # ---- stages ----------------------------------------------------------------------------------
    def compute_advantages(self, *, estimator, token_level_rewards, response_mask, uid,
                           values=None, gamma=1.0, lam=1.0, norm_adv_by_std_in_grpo=True):
        if estimator != "grpo":
            raise NotImplementedError(estimator)
        adv = toy.grpo_advantages(token_level_rewards, response_mask.double(),
                                  [str(u) for u in uid.tolist()], norm_adv_by_std_in_grpo)
        return adv, adv.clone()              # GRPO: returns = advantages (separate tensors)

    def apply_kl_in_reward(self, *, token_level_scores, old_log_probs, ref_log_probs,
                           response_mask, kl_coef, kl_penalty):
        kl = toy.kl_penalty(old_log_probs, ref_log_probs, kl_penalty) * response_mask
        return token_level_scores - kl_coef * kl, kl

    def kl_penalty(self, *, log_prob, ref_log_prob, kind):
        return toy.kl_penalty(log_prob, ref_log_prob, kind)

    def agg_loss(self, *, loss_mat, mask, mode, denominators=None):
        c = self._counts(mask, denominators)
        return toy.aggregate(loss_mat, mask.double(), mode, num_tokens=c["tokens"],
                             num_seqs=c["seqs"], norm_len=c["norm_len"])

    def policy_loss(self, *, old_log_prob, log_prob, advantages, response_mask, loss_mode,
                    loss_agg_mode, clip_ratio_low, clip_ratio_high, clip_ratio_c,
                    denominators=None):
        if loss_mode != "vanilla":
            raise NotImplementedError(loss_mode)
        cfg = toy.ToyConfig(clip_low=clip_ratio_low, clip_high=clip_ratio_high,
                            clip_c=clip_ratio_c, loss_agg_mode=loss_agg_mode)
        loss, stats = toy.ppo_loss(old_log_prob, log_prob, advantages, response_mask.double(),
                                   cfg, self._counts(response_mask, denominators))
        return loss, {METRICS[k]: v for k, v in stats.items()}

    def make_microbatches(self, batch, *, dp_size, micro_batch_size=None, max_token_len=None,
                          extra_padding=0):
        data = to_toy(batch)
        n = len(data["index"]) // dp_size
        shards = [toy.take(data, list(range(r * n, (r + 1) * n))) for r in range(dp_size)]
        ranks = [toy.split_micro_batches(s, rows=micro_batch_size, max_tokens=max_token_len)
                 for s in shards]
        most = max(len(r) for r in ranks) + extra_padding
        ranks = [r + [toy.padding_micro_batch(s) for _ in range(most - len(r))]
                 for r, s in zip(ranks, shards)]
        return [[from_toy(mb) for mb in r] for r in ranks]

    @staticmethod
    def _counts(mask, denominators):
        """rlaudit's Denominators (or the local counts) as ToyTrainer's count dict."""
        if denominators is not None:
            return {"tokens": denominators.tokens, "seqs": denominators.seqs,
                    "norm_len": denominators.norm_len}
        m = mask.bool()
        return {"tokens": int(m.sum()), "seqs": int(m.any(-1).sum()), "norm_len": m.shape[-1]}

    # ---- whole training step -------------------------------------------------------------------
    def _trainer(self, model_path, ref_model_path, batch, config, device):
        dtype = config.trainer.dtype
        model = load_model(model_path, dtype).to(device)
        ref = None
        if config.actor.use_kl_loss or config.algorithm.use_kl_in_reward:
            ref = load_model(ref_model_path or model_path, dtype).to(device)
        trainer = self.trainer_class(model, toy_config(config, len(batch)), ref)
        data = {k: v.to(device) if isinstance(v, torch.Tensor) else v
                for k, v in to_toy(batch).items()}
        return model, trainer, data

    def train_step(self, *, model_path, ref_model_path=None, batch, config, steps=1,
                   device="cpu"):
        model, trainer, data = self._trainer(model_path, ref_model_path, batch, config, device)
        out = TrainStepOutput(metrics=[])
        for step in range(steps):
            seen = len(trainer.micro_batches_seen)
            metrics, derived = trainer.step(data)
            out.metrics.append({METRICS[k]: v for k, v in metrics.items() if k in METRICS})
            if step == 0:   # step 0's old log-probs/entropy are the initial policy's
                out.log_probs, out.entropy = derived["old_log_probs"], derived["entropy"]
                out.tokens = {k: derived[k] for k in ("old_log_probs", "ref_log_probs", "kl",
                                                      "token_level_scores",
                                                      "token_level_rewards", "advantages",
                                                      "rollout_is_weights")
                              if k in derived}
            out.params.append({n: p.detach().clone() for n, p in model.named_parameters()})
            out.microbatches.append([[[from_toy(mb) for mb in micros]
                                      for micros in trainer.micro_batches_seen[seen:]]])
        return out

    def probe_model(self, *, model_path, ref_model_path=None, batch, config, step=0,
                    device="cpu"):
        """The actor as ToyTrainer holds it at the start of training step ``step`` (after
        ``step`` steps on ``batch``): rlaudit hooks its modules to say where a parity failure
        starts (docs/targets.md, "Where a parity failure starts: probe_model")."""
        model, trainer, data = self._trainer(model_path, ref_model_path, batch, config, device)
        for _ in range(step):
            trainer.step(data)
        return model
