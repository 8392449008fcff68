"""KL and rollout correction in verl's training step (verl_train.py): what of rlaudit's settings
maps onto verl 0.9.1's own code (:func:`kl_refusals` says what does not, and why), the trainer
config for it (:func:`reference_overrides`, :func:`rollout_correction_overrides`), and the rank
side: the reference worker group and KL controller ``RayPPOTrainer`` builds
(:func:`reference_policy`) and fit's reward step (:func:`shape_rewards`, verl's
``apply_kl_penalty`` and ``compute_rollout_correction_and_add_to_batch``). The KL loss itself is
verl's ``ppo_loss`` (workers/utils/losses.py:132-142), driven by ``actor.use_kl_loss``.
"""

from __future__ import annotations

import copy
from typing import Any

from rlaudit.config import Config

_FP32 = {"param_dtype": "fp32", "reduce_dtype": "fp32", "buffer_dtype": "fp32"}
K3 = ("k3", "low_var_kl", "k3+", "low_var_kl+")
#: the optimizer a training-mode engine builds for the reference worker (reference_overrides)
NEVER_STEPPED = {"_target_": "verl.workers.config.FSDPOptimizerConfig", "optimizer": "SGD",
                 "lr": 0.0, "weight_decay": 0.0}


def kl_refusals(cfg: Config) -> dict[str, bool]:
    """The KL and rollout-correction settings of ``cfg`` verl's step does not map (reason ->
    whether ``cfg`` has it)."""
    a, act = cfg.algorithm, cfg.actor
    rc = act.rollout_correction
    return {
        # kl_penalty_forward clamps k3 to [-10, 10] on every use (core_algos.py:2245)
        "algorithm.k3_clamp=none (verl always clamps k3 at 10)":
            a.k3_clamp != "value-10" and uses_k3(cfg),
        "actor.kl_loss_weight=ratio (verl's KL loss is unweighted, losses.py:132-142)":
            act.use_kl_loss and act.kl_loss_weight != "none",
        "actor.rollout_correction.rollout_is=geometric (verl 0.9.1's IS levels are token and "
        "sequence, rollout_corr_helper.py:565)": rc.rollout_is == "geometric",
        "actor.rollout_correction.rollout_is_mode=mask at sequence level (verl's IcePop "
        "metrics count tokens, not rows)":
            rc.rollout_is == "sequence" and rc.rollout_is_mode == "mask",
        "actor.rollout_correction.use_rollout_kl_loss (verl has no rollout-KL loss)":
            rc.use_rollout_kl_loss,
    }


def uses_k3(cfg: Config) -> bool:
    """Whether a KL term of ``cfg`` that this step maps uses the k3 estimator."""
    return ((cfg.actor.use_kl_loss and cfg.actor.kl_loss_type in K3)
            or (cfg.algorithm.use_kl_in_reward and cfg.algorithm.kl_penalty in K3))


def rollout_is_threshold(cfg: Config) -> float | str:
    """verl's ``rollout_is_threshold`` for rlaudit's truncate (TIS: the upper bound) or mask mode
    (IcePop: ``"lower_upper"``, weights outside the band zeroed, rollout_corr_helper.py:93-130,
    593-604; rlaudit's default lower bound is 1 / threshold)."""
    rc = cfg.actor.rollout_correction
    if rc.rollout_is_mode == "truncate":
        return float(rc.rollout_is_threshold)
    low = rc.rollout_is_threshold_lower
    low = 1.0 / rc.rollout_is_threshold if low is None else low
    return f"{float(low)!r}_{float(rc.rollout_is_threshold)!r}"


def reference_overrides(micro: int, device: str = "cpu") -> dict[str, Any]:
    """The reference worker's engine as the actor's (FSDP2, float32, no compile; verl's
    defaults are bf16 and torch.compile), its log-prob micro-batches as the old-log-prob pass's
    (verl's config check requires one when not dynamic). On the CPU its engine is not built
    ``forward_only``: that flag makes FSDP2 offload the reference's parameters to pinned host
    memory (``CPUOffloadPolicy(pin_memory=True)``, workers/engine/fsdp/transformer_impl.py:459-463
    at v0.9.1) and torch pins only with an accelerator. The parameters already live on the
    host there, so the offload changes nothing but where they sit; the flag's other effects
    (bf16 when no model_dtype is set, 262; no optimizer, 616) are set here or unused: the
    engine then builds an optimizer (:data:`NEVER_STEPPED`) the reference worker never steps
    (it only runs ``compute_ref_log_prob``)."""
    ref = "actor_rollout_ref.ref"
    out = {f"{ref}.log_prob_micro_batch_size_per_gpu": micro,
           f"{ref}.fsdp_config.strategy": "fsdp2", f"{ref}.fsdp_config.dtype": "float32",
           f"{ref}.fsdp_config.model_dtype": "fp32",
           f"{ref}.fsdp_config.mixed_precision": dict(_FP32),
           f"{ref}.fsdp_config.use_torch_compile": False}
    if device == "cpu":
        out[f"{ref}.fsdp_config.forward_only"] = False
        out[f"{ref}.optim"] = dict(NEVER_STEPPED)
    return out


def rollout_correction_overrides(cfg: Config) -> dict[str, Any]:
    """verl's ``algorithm.rollout_correction`` for rlaudit's: IS at the same level with the
    threshold (:func:`rollout_is_threshold`), no rejection sampling, no batch normalisation,
    decoupled mode (old log-probs recomputed, as rlaudit's reference does). The rollout's
    log-probs reach the trainer when the batch has them: verl's rollout computes them by
    default (``rollout.calculate_log_probs: true`` in the generated trainer config), and fit
    then logs the mismatch metrics whether or not IS is on, as rlaudit's reference does."""
    rc = cfg.actor.rollout_correction
    on = rc.rollout_is is not None
    at = "algorithm.rollout_correction"
    return {f"{at}.rollout_is": rc.rollout_is,
            f"{at}.rollout_is_threshold": rollout_is_threshold(cfg) if on else 2.0,
            f"{at}.rollout_rs": None, f"{at}.rollout_rs_threshold": None,
            f"{at}.bypass_mode": False, f"{at}.rollout_is_batch_normalize": False}


def reference_policy(trainer, ref_model: str | None):
    """What ``RayPPOTrainer.__init__`` / ``init_workers`` set up for a KL term (verl 0.9.1
    ray_trainer.py:343-365, 838-900): ``use_reference_policy`` (verl's need_reference_policy),
    the standalone reference worker group (``ActorRolloutRefWorker`` of role ``ref``, its model
    the reference snapshot ``ref_model``, initialised; returned for the caller to wrap in its
    worker group, None without a KL term) and the in-reward KL controller."""
    # lazy: verl is an optional peer, imported after the platform is selected
    from omegaconf import OmegaConf
    from verl.trainer.ppo import core_algos  # lazy: as above
    from verl.trainer.ppo.utils import need_reference_policy  # lazy: as above
    from verl.workers.engine_workers import ActorRolloutRefWorker  # lazy: as above

    cfg = trainer.config
    trainer.use_reference_policy = need_reference_policy(cfg)
    trainer.ref_in_actor = False
    if cfg.algorithm.use_kl_in_reward:
        trainer.kl_ctrl_in_reward = core_algos.get_kl_controller(cfg.algorithm.kl_ctrl)
    if not trainer.use_reference_policy:
        return None
    ref_cfg = copy.deepcopy(cfg)       # the reference worker's init_model edits its config
    if ref_model:
        OmegaConf.update(ref_cfg, "actor_rollout_ref.model.path", ref_model)
    ref = ActorRolloutRefWorker(config=ref_cfg.actor_rollout_ref, role="ref")
    ref.init_model()
    return ref


def shape_rewards(trainer, batch) -> tuple[Any, dict]:
    """fit's reward step (verl 0.9.1 ray_trainer.py:1632-1660): ``apply_kl_penalty`` with the
    trainer's KL controller when ``use_kl_in_reward`` (else rewards = scores), then, when the
    rollout's log-probs are in the batch, ``compute_rollout_correction_and_add_to_batch`` (IS
    weights and the ``rollout_corr/*`` metrics). Returns the batch and fit's metrics."""
    # lazy: verl is an optional peer, imported after the platform is selected
    from verl.trainer.ppo.ray_trainer import apply_kl_penalty
    from verl.trainer.ppo.rollout_corr_helper import (  # lazy: as above
        compute_rollout_correction_and_add_to_batch)

    alg = trainer.config.algorithm
    metrics: dict[str, float] = {}
    if alg.use_kl_in_reward:
        batch, kl_metrics = apply_kl_penalty(batch, kl_ctrl=trainer.kl_ctrl_in_reward,
                                             kl_penalty=alg.kl_penalty)
        metrics.update(kl_metrics)
    else:
        batch.batch["token_level_rewards"] = batch.batch["token_level_scores"]
    corr = alg.get("rollout_correction", None)
    if (corr is not None and "rollout_log_probs" in batch.batch.keys()
            and not corr.get("bypass_mode", False)):
        batch, is_metrics = compute_rollout_correction_and_add_to_batch(batch, corr)
        metrics.update(is_metrics)
    return batch, {k: float(v) for k, v in metrics.items()}
