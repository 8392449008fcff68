"""The rlaudit adapter over TRL's real ``GRPOTrainer`` (``rlaudit run --target trl``).

    pip install --no-deps --target .peers/trl-1.16.0 -r requirements/peers/trl-1.16.0.txt
    rlaudit run --target trl                       # built-in target scenario
    rlaudit run --target trl==1.14.2 trl_gradacc_uneven

``train_step`` builds a stock ``trl.GRPOTrainer`` and calls its ``train()``: TRL loads the
snapshot, computes old/reference log-probs, GRPO advantages, the loss of its ``loss_type``, the
gradient accumulation, clipping and optimizer step, and logs its metrics. Generation is replaced
through TRL's own seam for custom rollouts, ``rollout_func(prompts, trainer)``: it returns the
fixed rollout's prompt ids, completion ids, sampling log-probs and ``env_mask`` (TRL's mask for
tokens that are context but not trained on: rlaudit's masked holes). The reward function returns
the batch's scores; a rollout scored by several reward functions (rlaudit/data/rewards.py) gives
TRL one reward function per column, each returning that function's fixed scores (None where it
did not score the row), and their weights as ``reward_weights``: TRL combines and logs them
itself. Nothing of TRL's loss, advantage, reward or metric code is re-implemented here.

Two things the adapter sets that are not TRL config values (both data order, not math):

- TRL's sampler and ``shuffle_sequence_dict`` shuffle rows before cutting micro-batches; rlaudit
  cuts consecutive rows. ``shuffle_dataset=False`` and a ``shuffle_sequence_dict`` that applies
  the permutation from TRL's group-contiguous generation order to the batch's own row order make
  both trainers see the same micro-batches (TRL groups rows by position, so a group's rows must
  be contiguous when it computes advantages; they are put back in the batch's order right after,
  exactly where TRL itself shuffles).
- The reference policy: TRL builds it from the policy's own snapshot; the scenario's reference
  snapshot is substituted for that one ``create_model_from_path`` call.

docs/peers.md ("TRL") has the config mapping, the metric table, the conventions and declared
differences (each worked out on TRL's code) and the versions covered.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import warnings

import torch

from rlaudit.targets.contract.adapter import TargetAdapter, TrainStepOutput
from rlaudit.targets.peers.trl_declared import (canonical_kl, declared_differences,
                                                entropy_bonus_link, kl_link)
from rlaudit.targets.peers.trl_release import release_config_kwargs, train_precision_of
from rlaudit.targets.peers.trl_rewards import reward_funcs, reward_metric_map

#: rlaudit loss_agg_mode -> TRL loss_type (how TRL aggregates per-token losses)
LOSS_TYPES = {"token-mean": "dapo", "seq-mean-token-mean": "grpo",
              "seq-mean-token-sum-norm": "dr_grpo", "seq-mean-token-sum": "luspo"}
#: rlaudit loss_mode -> TRL importance_sampling_level (ratio per token, or per sequence = GSPO)
IS_LEVELS = {"vanilla": "token", "gspo": "sequence"}

SUPPORTED = ("1.0", "1.5", "1.9", "1.14", "1.16")


def trl_version() -> str:
    import trl  # lazy: TRL and its stack are optional, imported when audited
    return trl.__version__


def _minor(version: str) -> str:
    return ".".join(version.split(".")[:2])


# ---- metric mapping -------------------------------------------------------------------------

def metric_map(config) -> dict[str, str]:
    """TRL's logged name -> rlaudit catalogue name, for this config. TRL logs ``entropy``,
    ``kl`` and ``clip_ratio/*`` as token means of each micro-batch (averaged over the optimizer
    step's micro-batches), and Trainer's ``loss`` as the sum of what each micro-batch
    backpropagates (the optimizer step's whole loss): :attr:`TRLAdapter.metric_reduction`."""
    a = config.actor
    m = {"grad_norm": "actor/grad_norm", "learning_rate": "actor/lr",
         "reward": "critic/score/mean", "loss": "actor/loss"}
    # TRL logs these per micro-batch and averages them (metric_reduction = "microbatch-mean")
    if a.loss_mode == "vanilla":   # gspo: TRL counts clipped sequences, not tokens
        m["clip_ratio/region_mean"] = "actor/pg_clipfrac"
    if a.loss_agg_mode == "token-mean" and config.compute_entropy:
        # TRL always computes and logs it, as a token mean: rlaudit's actor/entropy when
        # entropy is asked for, and aggregated like the loss (token-mean) only then
        m["entropy"] = "actor/entropy"
    if not a.use_kl_loss and a.entropy_coeff == 0:
        # TRL's loss is then its policy loss alone (no KL or entropy term added)
        m["loss@pg"] = "actor/pg_loss"
    if a.use_kl_loss and a.loss_agg_mode == "token-mean":
        # its per_token_kl (k3 x the importance ratio) as each micro-batch's token mean: the
        # term beta multiplies, which the reference computes under trl-kl-bias-corrected-k3
        m["kl"] = "actor/kl_loss"
    return m


def trl_config_kwargs(config, rows: int, response_width: int, output_dir: str, steps: int,
                      reward_weights=(1.0,)):
    """rlaudit Config -> GRPOConfig keyword arguments (docs/peers.md, "config mapping");
    ``reward_weights``: one per reward function (:meth:`FixedRollout.reward_funcs`)."""
    a, alg, r = config.actor, config.algorithm, config.rollout
    mini = min(a.ppo_mini_batch_size * r.n, rows)
    micro = a.ppo_micro_batch_size_per_gpu
    ga = mini // micro
    minis = rows // mini
    low = a.clip_ratio if a.clip_ratio_low is None else a.clip_ratio_low
    high = a.clip_ratio if a.clip_ratio_high is None else a.clip_ratio_high
    norm_len = a.loss_scale_factor if a.loss_scale_factor is not None else response_width
    kw = dict(
        output_dir=output_dir, report_to=[], save_strategy="no", logging_steps=1,
        disable_tqdm=True, use_cpu=True, bf16=False, fp16=False, seed=config.trainer.seed,
        data_seed=config.trainer.seed, dataloader_num_workers=0,
        # Hugging Face's default attention (sdpa): eager attention turns left-padded rows NaN
        model_init_kwargs={"dtype": getattr(torch, config.trainer.dtype)},
        per_device_train_batch_size=micro, gradient_accumulation_steps=ga,
        # one generation per rlaudit step: TRL's steps_per_generation cuts it into the step's
        # mini-batches (optimizer steps) and num_iterations replays it ppo_epochs times
        steps_per_generation=ga * minis, num_iterations=a.ppo_epochs,
        max_steps=steps * minis * a.ppo_epochs, num_generations=r.n,
        shuffle_dataset=False, temperature=r.temperature,
        max_completion_length=int(norm_len),
        loss_type=LOSS_TYPES[a.loss_agg_mode],
        importance_sampling_level=IS_LEVELS[a.loss_mode],
        epsilon=low, epsilon_high=high,
        # TRL's two-sided clip caps the ratio at delta; for delta >= 1 + epsilon_high that is
        # verl's dual clip of negative advantages (rlaudit's GSPO has none)
        delta=a.clip_ratio_c if a.loss_mode == "vanilla" else None,
        beta=a.kl_loss_coef if a.use_kl_loss else 0.0,
        use_bias_correction_kl=True,    # TRL's default, said here: a convention below
        scale_rewards="group" if (alg.adv_estimator == "grpo" and alg.norm_adv_by_std_in_grpo)
        else "none",
        entropy_coef=a.entropy_coeff,
        reward_weights=[float(w) for w in reward_weights],
        learning_rate=a.optim.lr, lr_scheduler_type="constant", warmup_steps=0,
        weight_decay=a.optim.weight_decay,
        max_grad_norm=a.grad_clip if a.grad_clip > 0 else 0.0,
        log_completions=False, disable_dropout=True, use_liger_kernel=False,
        gradient_checkpointing=False,   # memory only; recomputation triples CPU time
    )
    if a.optim.name == "sgd":
        kw["optim"] = "sgd"
    else:
        kw.update(optim="adamw_torch", adam_beta1=a.optim.betas[0], adam_beta2=a.optim.betas[1],
                  adam_epsilon=a.optim.eps)
    return kw


# ---- the fixed rollout as TRL's rollout_func --------------------------------------------------

class FixedRollout:
    """rlaudit's batch as TRL's generation: ``rollout_func`` and the reward function.

    The dataset has one prompt per group ("group:<g>", groups in order of first appearance), so
    TRL's sampler (shuffle_dataset=False) yields each group's prompt ``n`` times in a row; the
    k-th occurrence of a group is that group's k-th row in the batch. ``order`` is the batch row
    of each generation row (TRL's order), and :meth:`to_batch_order` the permutation back.
    """

    def __init__(self, batch, pad_token_id: int):
        t = batch.tensors
        self.batch = batch
        self.uids = [int(u) for u in t["uid"].tolist()]
        self.groups = list(dict.fromkeys(self.uids))
        self.rows_of = {u: [i for i, x in enumerate(self.uids) if x == u] for u in self.groups}
        sizes = {len(v) for v in self.rows_of.values()}
        if len(sizes) != 1:
            raise NotImplementedError(f"TRL needs every group to have num_generations rows; "
                                      f"group sizes here: {sorted(sizes)}")
        pl, rl = t["prompt_lengths"].tolist(), t["response_lengths"].tolist()
        mask = t["response_mask"]
        self.prompt_ids = [t["prompt_ids"][i, :pl[i]].tolist() for i in range(len(batch))]
        self.completion_ids, self.env_mask, self.logprobs = [], [], []
        lp = t.get("rollout_log_probs")
        for i in range(len(batch)):
            n = int(rl[i])
            if n == 0:
                # TRL cannot hold an empty completion (its length metrics read ids[-1]): one pad
                # token, masked out of every loss and metric by env_mask
                self.completion_ids.append([pad_token_id])
                self.env_mask.append([0])
                self.logprobs.append([0.0])
                continue
            self.completion_ids.append(t["response_ids"][i, :n].tolist())
            self.env_mask.append([int(x) for x in mask[i, :n].tolist()])
            self.logprobs.append(lp[i, :n].tolist() if lp is not None else [0.0] * n)
        self.order: list[int] = []
        self.generations = 0

    def prompts(self) -> list[str]:
        return [f"group:{k}" for k in range(len(self.groups))]

    def __call__(self, prompts, trainer):
        seen: dict[int, int] = {}
        order = []
        for p in prompts:
            k = int(str(p).split(":", 1)[1])
            j = seen.get(k, 0)
            seen[k] = j + 1
            order.append(self.rows_of[self.groups[k]][j])
        self.order = order
        self.generations += 1
        return {"prompt_ids": [self.prompt_ids[i] for i in order],
                "completion_ids": [self.completion_ids[i] for i in order],
                "logprobs": [self.logprobs[i] for i in order],
                "env_mask": [self.env_mask[i] for i in order],
                "row": list(order)}

    def reward(self, prompts, completions, row, **kwargs):
        scores = self.batch["scores"]
        return [float(scores[i]) for i in row]

    def reward_funcs(self) -> tuple[list, list[float]]:
        """(TRL's reward functions, their weights): :func:`trl_rewards.reward_funcs`."""
        return reward_funcs(self.batch, self.reward)

    def to_batch_order(self) -> torch.Tensor:
        """perm such that generation_row[perm[j]] is batch row j."""
        pos = {r: p for p, r in enumerate(self.order)}
        return torch.tensor([pos[j] for j in range(len(self.order))])


def _permute(seq_dict: dict, perm: torch.Tensor) -> dict:
    out = {}
    for k, v in seq_dict.items():
        if v is None or (isinstance(v, torch.Tensor) and v.ndim == 0):
            out[k] = v
        elif isinstance(v, torch.Tensor):
            out[k] = v[perm.to(v.device)]
        else:
            out[k] = [v[i] for i in perm.tolist()]
    return out


@contextlib.contextmanager
def _patched(module, name, value):
    old = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, old)


# ---- the adapter ------------------------------------------------------------------------------

class TRLAdapter(TargetAdapter):
    """TRL's GRPOTrainer through ``train_step`` (stage methods: see docs/peers.md, "TRL")."""

    name = "trl"
    advantage_estimators = ("grpo", "drgrpo")
    loss_modes = ("vanilla", "gspo")
    #: Trainer's ``loss`` sums what each micro-batch backpropagates (contributions, TRL's own
    #: normalisers); TRL's ``entropy``, ``kl``, ``clip_ratio/*`` are each micro-batch's token
    #: mean (``global_masked_mean``), averaged over the logging window's micro-batches
    metric_reduction = {"actor/loss": "contribution", "actor/pg_loss": "contribution",
                        "*": "microbatch-mean"}
    #: logged in every configuration (the others depend on the config: metric_map)
    metric_names = ("actor/grad_norm", "actor/lr", "actor/loss", "critic/score/mean")
    trainer_class = None          # tests may swap in a subclass of TRL's GRPOTrainer
    config_class = None           # tests may swap in a stand-in of a release's GRPOConfig

    def __init__(self):
        self.version = trl_version()
        # the report column names the release audited (as verl's and SkyRL's do)
        self.name = f"trl-{self.version}"
        minor = _minor(self.version)
        if minor not in SUPPORTED:
            warnings.warn(f"TRL {self.version} is not a version this adapter was checked "
                          f"against ({', '.join(SUPPORTED)}); results may be n/a or differ")
        self.train_precision = train_precision_of(self.version)
        self.differences = declared_differences(self.version)

    def supports(self, config):
        a, alg, rc = config.actor, config.algorithm, config.actor.rollout_correction
        unsupported = {
            f"adv_estimator {alg.adv_estimator}": alg.adv_estimator not in ("grpo", "drgrpo"),
            f"loss_mode {a.loss_mode}": a.loss_mode not in IS_LEVELS,
            f"loss_agg_mode {a.loss_agg_mode}": a.loss_agg_mode not in LOSS_TYPES,
            "seq-mean-token-sum only with loss_mode gspo (TRL's luspo)":
                a.loss_agg_mode == "seq-mean-token-sum" and a.loss_mode != "gspo",
            # TRL's KL term (beta) is k3 = exp(ref - logp) - (ref - logp) - 1 times the
            # differentiable importance ratio (use_bias_correction_kl), computed by the reference
            # under the conventions of trl-kl-bias-corrected-k3; TRL has no other estimator,
            # computes no KL at all with beta = 0, and logs its KL only as a token mean
            f"use_kl_loss with kl_loss_type {a.kl_loss_type} (TRL's beta term is k3: "
            f"{kl_link(self.version)})":
                a.use_kl_loss and canonical_kl(a.kl_loss_type) != "k3",
            "use_kl_loss with kl_loss_coef 0 (TRL's beta = 0 computes and logs no KL)":
                a.use_kl_loss and a.kl_loss_coef == 0,
            "use_kl_loss unless token-mean (TRL logs its KL term only as micro-batch token means)":
                a.use_kl_loss and a.loss_agg_mode != "token-mean",
            "KL in reward": alg.use_kl_in_reward,
            "rollout correction (TRL applies it only with use_vllm=True)":
                rc.rollout_is is not None or rc.use_rollout_kl_loss,
            "distillation": a.distill.enable, "shuffle": a.shuffle,
            "overlong buffer": config.reward.overlong_buffer.enable,
            "token-budget micro-batches (use_dynamic_bsz)": a.use_dynamic_bsz,
            "padding micro-batches": config.trainer.extra_padding_microbatches > 0,
            "weight decay (HF Trainer exempts biases and norms)": a.optim.weight_decay != 0,
            "uneven micro-batch rows (TRL cuts equal ones)":
                (a.ppo_mini_batch_size * config.rollout.n) % a.ppo_micro_batch_size_per_gpu != 0,
            "dual clip bound <= 1 + clip_ratio_high":
                a.clip_ratio_c <= 1 + (a.clip_ratio if a.clip_ratio_high is None
                                       else a.clip_ratio_high),
            # TRL adds entropy_coef x (the mean over the optimizer step's micro-batches of each
            # one's token-mean entropy); rlaudit aggregates the entropy term like the policy
            # loss. Equal only for token-mean with one micro-batch and one mini-batch per step.
            f"entropy_coeff != 0 unless token-mean with one micro-batch per step (TRL's entropy "
            f"bonus is a mean of micro-batch token means: {entropy_bonus_link(self.version)})":
                a.entropy_coeff != 0 and not (
                    a.loss_agg_mode == "token-mean"
                    and a.ppo_micro_batch_size_per_gpu >= a.ppo_mini_batch_size * config.rollout.n
                    and a.ppo_mini_batch_size >= config.data.train_batch_size),
        }
        why = [k for k, bad in unsupported.items() if bad]
        return not why, ", ".join(why)

    # ---- whole training step -----------------------------------------------------------------
    def train_step(self, *, model_path, ref_model_path=None, batch, config, steps=1,
                   device="cpu"):
        import datasets  # lazy: TRL and its stack are optional, imported when audited
        # lazy: TRL and its stack are optional, imported when audited
        from transformers import AutoTokenizer, TrainerCallback
        import trl  # lazy: TRL and its stack are optional, imported when audited
        # lazy: TRL and its stack are optional, imported when audited
        from trl.trainer import grpo_trainer as gt

        os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
        tokenizer = AutoTokenizer.from_pretrained(str(model_path))
        rollout = FixedRollout(batch, tokenizer.pad_token_id)
        rows = len(batch)
        mini = min(config.actor.ppo_mini_batch_size * config.rollout.n, rows)
        per_step = (rows // mini) * config.actor.ppo_epochs     # optimizer steps per rlaudit step
        if rows % mini:
            raise NotImplementedError(f"{rows} rows do not cut into mini-batches of {mini}")
        with tempfile.TemporaryDirectory(prefix="rlaudit-trl-") as tmp:
            funcs, weights = rollout.reward_funcs()
            kwargs = trl_config_kwargs(config, rows, batch.response_width, tmp, steps,
                                       reward_weights=weights)
            config_class = self.config_class or trl.GRPOConfig
            args = config_class(**release_config_kwargs(config_class, kwargs, self.version))
            dataset = datasets.Dataset.from_dict({"prompt": rollout.prompts()})
            policy = gt.create_model_from_path(str(model_path), **args.model_init_kwargs)
            captured: dict = {"params": [], "first": None}
            cls = self._trainer_class(captured)

            class _Params(TrainerCallback):
                def on_step_end(self, args_, state, control, model=None, **kw):
                    if state.global_step % per_step == 0:
                        captured["params"].append({n: p.detach().clone() for n, p in
                                                   policy.named_parameters()})

            ref_path = str(ref_model_path or model_path)
            orig_create = gt.create_model_from_path

            def create_ref(path, **kw):   # the one call left in __init__: the reference policy
                return orig_create(ref_path, **kw)

            def in_batch_order(seq_dict):  # TRL's shuffle before cutting micro-batches
                return _permute(seq_dict, rollout.to_batch_order())

            with _patched(gt, "create_model_from_path", create_ref), \
                    _patched(gt, "shuffle_sequence_dict", in_batch_order), \
                    warnings.catch_warnings():
                warnings.simplefilter("ignore")
                trainer = cls(model=policy, reward_funcs=funcs, args=args,
                              train_dataset=dataset, processing_class=tokenizer,
                              rollout_func=rollout, callbacks=[_Params()])
                trainer.train()
            history = [h for h in trainer.state.log_history if "loss" in h or "grad_norm" in h]
        return self._output(history, captured, rollout, config, steps, per_step, batch)

    def _trainer_class(self, captured):
        """TRL's GRPOTrainer (or the test's subclass), recording what step 0 held: the first
        generation batch's advantages/old/ref log-probs and the initial policy's log-probs and
        entropy, computed by TRL's own ``_get_per_token_logps_and_entropies``."""
        from trl import GRPOTrainer  # lazy: TRL and its stack are optional, imported when audited
        base = self.trainer_class or GRPOTrainer

        class Recording(base):
            def _generate_and_score_completions(self, inputs):
                out = super()._generate_and_score_completions(inputs)
                if captured["first"] is None:
                    ids = torch.cat([out["prompt_ids"], out["completion_ids"]], 1)
                    att = torch.cat([out["prompt_mask"], out["completion_mask"]], 1)
                    with torch.no_grad():
                        lp, ent, *_ = self._get_per_token_logps_and_entropies(
                            self.model, ids, att, out["completion_ids"].size(1),
                            batch_size=self.args.per_device_train_batch_size,
                            compute_entropy=True)
                    captured["first"] = dict(out, probe_log_probs=lp, probe_entropy=ent)
                return out

        return Recording

    def _output(self, history, captured, rollout, config, steps, per_step, batch):
        if len(history) != steps * per_step:
            raise RuntimeError(f"TRL logged {len(history)} optimizer steps, expected "
                               f"{steps * per_step}")
        names = {**metric_map(config), **reward_metric_map(batch)}
        out = TrainStepOutput(metrics=[], params=captured["params"])
        for s in range(steps):
            logs = history[s * per_step:(s + 1) * per_step]
            step = {}
            for trl_name, ours in names.items():
                key = trl_name.split("@")[0]
                vals = [h[key] for h in logs if h.get(key) is not None]
                if vals:   # batch metrics are logged once per generation, the rest per step
                    step[ours] = sum(vals) / len(vals)
            out.metrics.append(step)
        first = captured["first"]
        if first is not None:
            out.log_probs = self._to_batch(first["probe_log_probs"], rollout, batch)
            out.entropy = self._to_batch(first["probe_entropy"], rollout, batch)
            adv = first["advantages"]
            adv = adv.unsqueeze(1).expand(-1, first["completion_ids"].size(1))
            out.tokens = {"advantages": self._to_batch(adv, rollout, batch)}
            if "old_per_token_logps" in first:
                out.tokens["old_log_probs"] = self._to_batch(first["old_per_token_logps"],
                                                             rollout, batch)
            if "ref_per_token_logps" in first:
                out.tokens["ref_log_probs"] = self._to_batch(first["ref_per_token_logps"],
                                                             rollout, batch)
        return out

    @staticmethod
    def _to_batch(t, rollout, batch):
        """[B, C] in generation order (C = longest completion) -> [B, R] float64 in batch order,
        0 where the response mask is False."""
        t = t.detach().double().cpu()
        order = torch.tensor(rollout.order)
        out = torch.zeros(batch.mask.shape, dtype=torch.float64)
        width = min(t.shape[1], out.shape[1])
        out[order, :width] = t[:, :width]
        return torch.where(batch.mask, out, 0.0)
