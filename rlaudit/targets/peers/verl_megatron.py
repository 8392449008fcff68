"""verl 0.7.1's legacy Megatron actor, driven with verl's real code on a real megatron-core model on
the CPU: ``MegatronPPOActor`` (verl/workers/actor/megatron_actor.py) over a megatron-core GPTModel
built by rlaudit's own Megatron backend (rlaudit/backends/megatron: megatron-core 0.16 over gloo,
its CUDA assumptions redirected by ``compat``), wrapped in megatron's ``DistributedDataParallel``
with megatron's optimizer, as verl's Megatron worker builds them.

    out = train_steps(model_path, [(batch, cfg, steps)], peer=".peers/verl-0.7.1")[0]
    out["metrics"][step]          # verl's names, reduced as fit reduces them

Per step, in ``RayPPOTrainer.fit``'s order (verl 0.7.1 ray_trainer.py): the old log-probs and
entropy through ``MegatronPPOActor.compute_log_prob`` with the meta-info the Megatron worker sets
(megatron_workers.py:879-882), rewards = scores, the trainer's ``compute_advantage``, the trainer's
own ``_update_actor`` (its legacy branch hands the batch to the worker group), whose ``update_actor``
here is the worker's glue (megatron_workers.py:757-774: the micro-batch size, the actor's
``make_minibatch_iterator`` and ``update_policy``, verl's ``get_megatron_last_lr``), then
``reduce_metrics``.

What stands in for verl, and why it is faithful:

- verl 0.7.1 has no platform registry; on a host without CUDA its ``verl.utils.device`` already
  answers ``cpu`` (``get_device_name``), and ``torch.cpu`` lacks the one call verl makes on it that
  torch.cuda has, ``empty_cache`` (megatron_actor.py:331): a no-op is added to ``torch.cpu`` (a
  cache hint, no numerics).
- verl's "bshd" forward hands the model a 2-D padding mask ``[b, s]`` (models/mcore/
  model_forward.py:147), which Transformer Engine's attention turns into a causal + padding mask.
  rlaudit's GPTModel uses megatron's local attention (no Transformer Engine on CPU), which wants
  that 4-D mask: :class:`MaskedGPT` converts it (rlaudit.backends.megatron.model.
  attention_mask_4d) and forwards everything else to the GPTModel.
- hydra-core (``omega_conf_to_dataclass``, utils/config.py:48) comes with the peer
  (requirements/peers/verl-0.7.1.txt).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import torch

from rlaudit.backends.launch import launch
from rlaudit.config import Config
from rlaudit.data.batch import RolloutBatch
from rlaudit.targets.peers.verl_layout import verl_tensors
from rlaudit.targets.peers.verl_train import ESTIMATORS, rollout_proto
from rlaudit.targets.peers.step_config import WrappedGPT, unmapped_layout

#: verl 0.7.1's own Megatron trainer defaults, inside the installed package
DEFAULT_CONFIG = "trainer/config/_generated_ppo_megatron_trainer.yaml"
_AR = "actor_rollout_ref"


def unsupported(cfg: Config) -> list[str]:
    """The settings this path does not map (empty: it runs)."""
    a, act, t = cfg.algorithm, cfg.actor, cfg.trainer
    rc = act.rollout_correction
    checks = {
        f"algorithm.adv_estimator={a.adv_estimator!r}": a.adv_estimator not in ESTIMATORS,
        "KL (no reference worker)": act.use_kl_loss or a.use_kl_in_reward,
        "rollout correction": rc.rollout_is is not None or rc.use_rollout_kl_loss,
        f"actor.loss_mode={act.loss_mode!r}": act.loss_mode != "vanilla",
        "token-budget micro-batches (use_dynamic_bsz)": act.use_dynamic_bsz,
        f"trainer.dtype={t.dtype!r}": t.dtype not in ("float32", "float64"),
        **unmapped_layout(cfg),
    }
    return [why for why, bad in checks.items() if bad]


def overrides(cfg: Config, *, rows: int) -> dict[str, Any]:
    """Dotted keys of verl 0.7.1's Megatron trainer config -> values for ``cfg``."""
    act, a = cfg.actor, cfg.algorithm
    estimator, norm = ESTIMATORS[a.adv_estimator]
    mini = min(act.ppo_mini_batch_size, max(rows // cfg.rollout.n, 1))
    low = act.clip_ratio if act.clip_ratio_low is None else act.clip_ratio_low
    high = act.clip_ratio if act.clip_ratio_high is None else act.clip_ratio_high
    actor = f"{_AR}.actor"
    return {
        # in rows, as the Megatron worker's __init__ normalises it (megatron_workers.py:355-356:
        # times rollout.n, over the dp size, 1 here) before the actor reads it
        f"{actor}.ppo_mini_batch_size": mini * cfg.rollout.n,
        f"{actor}.ppo_micro_batch_size_per_gpu": act.ppo_micro_batch_size_per_gpu,
        f"{actor}.ppo_epochs": act.ppo_epochs, f"{actor}.shuffle": False,
        f"{actor}.use_dynamic_bsz": False, f"{actor}.megatron.use_remove_padding": False,
        f"{actor}.clip_ratio": act.clip_ratio, f"{actor}.clip_ratio_low": low,
        f"{actor}.clip_ratio_high": high, f"{actor}.clip_ratio_c": act.clip_ratio_c,
        f"{actor}.loss_agg_mode": act.loss_agg_mode,
        f"{actor}.policy_loss.loss_mode": act.loss_mode,
        f"{actor}.entropy_coeff": act.entropy_coeff,
        f"{actor}.calculate_entropy": act.calculate_entropy, f"{actor}.use_kl_loss": False,
        f"{_AR}.rollout.n": cfg.rollout.n, f"{_AR}.rollout.temperature": cfg.rollout.temperature,
        f"{_AR}.rollout.log_prob_micro_batch_size_per_gpu": act.ppo_micro_batch_size_per_gpu,
        f"{_AR}.rollout.log_prob_use_dynamic_bsz": False,
        "algorithm.adv_estimator": estimator, "algorithm.gamma": a.gamma, "algorithm.lam": a.lam,
        "algorithm.norm_adv_by_std_in_grpo": a.norm_adv_by_std_in_grpo if norm is None else norm,
        "algorithm.use_kl_in_reward": False,
    }


def train_steps(model_path, jobs: list[tuple[RolloutBatch, Config, int]], *, peer: str,
                device: str = "cpu", backend: str | None = None,
                timeout: float = 300.0) -> list[dict]:
    """Each ``(batch, config, steps)`` of ``jobs`` through verl's Megatron actor, one rank
    (tp = pp = dp = 1; gloo on ``cpu``, NCCL on ``cuda`` unless ``backend`` says), a fresh model
    per job. Returns the rank's results."""
    for _batch, cfg, _steps in jobs:
        bad = unsupported(cfg)
        if bad:
            raise NotImplementedError(f"verl's Megatron actor path does not map: {'; '.join(bad)}")
    request = {"peer": peer, "model": str(model_path), "device": device,
               "jobs": [{"steps": steps, "optim": _optim(cfg), "overrides": overrides(
                   cfg, rows=len(batch)), "tensors": verl_tensors(
                   batch, width=cfg.rollout.response_length)} for batch, cfg, steps in jobs]}
    return launch(train_rank, 1, args=(request,), timeout=timeout * len(jobs), device=device,
                  backend=backend)[0]


def _optim(cfg: Config) -> dict:
    o = cfg.actor.optim
    # rlaudit's grad_clip <= 0 is "no clipping"; megatron's optimizer then computes no grad norm
    # at all (optimizer.py:606: verl would log None): inf clips nothing and keeps the norm
    clip = cfg.actor.grad_clip if cfg.actor.grad_clip > 0 else float("inf")
    return {"name": o.name, "lr": o.lr, "weight_decay": o.weight_decay, "betas": list(o.betas),
            "eps": o.eps, "clip": clip}


def train_rank(info, request: dict) -> list[dict]:
    """The rank body: verl 0.7.1 on the path, megatron initialised, then every job."""
    peer = request["peer"]
    sys.path[:] = [p for p in sys.path if p == peer or Path(p).parent != Path(peer).parent]
    if peer not in sys.path:
        sys.path.insert(0, peer)
    if request["device"] == "cpu" and not hasattr(torch.cpu, "empty_cache"):
        torch.cpu.empty_cache = lambda: None     # module docstring
    from rlaudit.backends.megatron import compat  # lazy: megatron-core, inside the rank only
    compat.init_megatron(tp=1, pp=1, seed=1234)
    try:
        return [train_job(request["model"], job, device=request["device"])
                for job in request["jobs"]]
    finally:
        compat.teardown_megatron()


def train_job(model_path: str, job: dict, *, device: str = "cpu") -> dict:
    """One job (module docstring): per step the reduced metrics and the parameters after it by
    Hugging Face name; step 0's per-token tensors."""
    # lazy: verl 0.7.1 is an optional peer, on the path only inside this rank
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer
    from verl.utils.config import omega_conf_to_dataclass  # lazy: as above
    from verl.workers.actor.megatron_actor import MegatronPPOActor  # lazy: as above

    from rlaudit.backends.megatron.convert import gather_hf_state_dict  # lazy: megatron-core
    cfg = verl_config(job["overrides"], DEFAULT_CONFIG)
    gpt, ddp, optimizer, hf_config = build_actor(model_path, job["optim"], device=device)
    actor = MegatronPPOActor(config=omega_conf_to_dataclass(cfg.actor_rollout_ref.actor),
                             model_config=hf_config, hf_config=hf_config, tf_config=gpt.config,
                             actor_module=[ddp], actor_optimizer=optimizer)
    trainer = RayPPOTrainer.__new__(RayPPOTrainer)
    trainer.config, trainer.use_legacy_worker_impl = cfg, "auto"
    trainer.actor_rollout_wg = LegacyMegatronGroup(actor, optimizer, cfg)
    result: dict[str, Any] = {"metrics": [], "params": []}
    for step in range(job["steps"]):
        metrics, tokens = fit_step(trainer, actor, rollout_proto(job["tensors"], cfg))
        result["metrics"].append(metrics)
        if step == 0:
            result["tokens"] = tokens
        result["params"].append({k: v.detach().cpu().clone()
                                 for k, v in gather_hf_state_dict(gpt, hf_config).items()})
    return result


def fit_step(trainer, actor, batch) -> tuple[dict, dict]:
    """fit()'s order (module docstring) for one step; (reduced metrics, step tensors)."""
    # lazy: verl 0.7.1 is an optional peer, on the path only inside this rank
    from verl import DataProto
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer, compute_advantage  # lazy: as above
    from verl.utils.metric import reduce_metrics  # lazy: as above

    cfg = trainer.config
    rollout = cfg.actor_rollout_ref.rollout
    # megatron_workers.py:879-882, then its call at 891
    probe = DataProto(batch=batch.batch.clone(), meta_info={
        "micro_batch_size": rollout.log_prob_micro_batch_size_per_gpu, "max_token_len": None,
        "use_dynamic_bsz": False, "temperature": rollout.temperature})
    old_log_probs, entropys, _topk = actor.compute_log_prob(data=probe, calculate_entropy=True)
    batch.batch["old_log_probs"] = old_log_probs
    batch.batch["token_level_rewards"] = batch.batch["token_level_scores"]
    alg = cfg.algorithm
    batch = compute_advantage(batch, adv_estimator=alg.adv_estimator, gamma=alg.gamma,
                              lam=alg.lam, num_repeat=rollout.n,
                              norm_adv_by_std_in_grpo=alg.norm_adv_by_std_in_grpo, config=alg)
    out = RayPPOTrainer._update_actor(trainer, batch)
    metrics = {k: float(v) for k, v in reduce_metrics(out.meta_info["metrics"]).items()}
    tokens = {k: batch.batch[k].detach().clone() for k in
              ("old_log_probs", "advantages", "returns", "token_level_scores",
               "token_level_rewards")}
    tokens["entropys"] = entropys.detach().clone()
    return metrics, tokens


class LegacyMegatronGroup:
    """The worker group of a one-rank legacy Megatron actor: ``update_actor`` is the Megatron
    worker's (megatron_workers.py:757-774) around the real actor and optimizer."""

    def __init__(self, actor, optimizer, cfg):
        self.actor, self.optimizer, self.cfg = actor, optimizer, cfg

    def update_actor(self, data):
        # lazy: verl 0.7.1 is an optional peer, on the path only inside this rank
        from verl import DataProto
        from verl.utils.megatron.optimizer import get_megatron_last_lr  # lazy: as above
        data.meta_info["micro_batch_size"] = \
            self.cfg.actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu
        metrics = self.actor.update_policy(dataloader=self.actor.make_minibatch_iterator(data))
        metrics["actor/lr"] = get_megatron_last_lr(self.optimizer)
        return DataProto(meta_info={"metrics": metrics})


class MaskedGPT(WrappedGPT):
    """The GPTModel with verl's 2-D padding mask turned into megatron's 4-D causal + padding mask
    (module docstring); every other attribute is the GPTModel's (``module``: megatron's
    ``get_attr_wrapped_model`` unwraps through it)."""

    def forward(self, input_ids, position_ids, attention_mask, **kwargs):
        # lazy: megatron-core pieces of rlaudit's backend, inside the rank only
        from rlaudit.backends.megatron.model import attention_mask_4d
        if attention_mask is not None and attention_mask.dim() == 2:
            attention_mask = attention_mask_4d(attention_mask)
        return self.module(input_ids, position_ids, attention_mask, **kwargs)


def build_actor(model_path: str, optim: dict, *, device: str = "cpu"):
    """GPTModel (float32, the snapshot's weights) -> :class:`MaskedGPT` -> megatron DDP ->
    megatron optimizer, as rlaudit's Megatron backend builds its actor."""
    # lazy: megatron-core: optional, imported inside the rank only
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer  # lazy: as above
    from safetensors.torch import load_file  # lazy: as above
    from transformers import AutoConfig  # lazy: as above

    from rlaudit.backends.megatron.context import CONFIG_OVERRIDES  # lazy: megatron backend
    from rlaudit.backends.megatron.convert import load_hf_weights  # lazy: as above
    from rlaudit.backends.megatron.model import build_gpt_model, freeze_padding_embedding
    hf_config = AutoConfig.from_pretrained(model_path)
    state = {}
    for f in sorted(Path(model_path).glob("*.safetensors")):
        state.update(load_file(str(f)))
    gpt = build_gpt_model(hf_config, dtype=torch.float32, overrides=CONFIG_OVERRIDES)
    gpt = gpt.to(torch.cuda.current_device() if device == "cuda" else "cpu")
    load_hf_weights(gpt, state, hf_config)
    freeze_padding_embedding(gpt, hf_config)
    ddp = DistributedDataParallel(gpt.config, DistributedDataParallelConfig(
        overlap_grad_reduce=False, use_distributed_optimizer=False), MaskedGPT(gpt))
    opt = OptimizerConfig(
        optimizer="adam" if optim["name"] == "adamw" else "sgd", lr=optim["lr"],
        min_lr=optim["lr"], weight_decay=optim["weight_decay"], adam_beta1=optim["betas"][0],
        adam_beta2=optim["betas"][1], adam_eps=optim["eps"], decoupled_weight_decay=True,
        sgd_momentum=0.0, clip_grad=optim["clip"], bf16=False, fp16=False,
        params_dtype=torch.float32, use_distributed_optimizer=False)
    optimizer = get_megatron_optimizer(opt, [ddp], config_overrides={})
    ddp.train()
    return gpt, ddp, optimizer, hf_config


def verl_config(values: dict[str, Any], defaults: str):
    """verl's generated trainer config ``defaults`` (a path inside the installed package) with
    ``values`` (dotted keys) set."""
    # lazy: verl (and omegaconf, from its peer directory) only exist inside the rank
    import verl
    from omegaconf import OmegaConf  # lazy: from verl's peer directory
    cfg = OmegaConf.load(os.path.join(os.path.dirname(verl.__file__), defaults))
    for key, value in values.items():
        OmegaConf.update(cfg, key, value, force_add=True)
    return cfg
