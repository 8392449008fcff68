"""TRL's ``GRPOConfig`` keys, each accounted for: set by the adapter from rlaudit's config
(``trl_config_kwargs``; the knob table of docs/targets.md says which scenarios and fuzz draws
vary each, or, :data:`UNVARIED`, why none does), set to a fixed value (:data:`FIXED`, with the
reason), or not set (:data:`NOT_SET`:
n/a with the reason; those that change a loss, normaliser, mask, window or logged reward say
what rlaudit would need to vary them). ``tests/targets/peers/test_trl_knobs.py`` fails on a
``GRPOConfig`` field of the installed release that is in none of them, and on a mapped key that
nothing varies.
"""

from __future__ import annotations

from rlaudit.targets.peers.trl import trl_config_kwargs
from rlaudit.targets.peers.trl_rewards import reward_funcs

#: the keyword that names a scratch directory (not a knob)
OUTPUT_DIR = "output_dir"

#: keys ``trl_config_kwargs`` sets to one value whatever the config: why
FIXED = {
    "report_to": "no logging integration: metrics are read from the trainer's log history",
    "save_strategy": "no checkpoints: parameters are read from the model after each step",
    "logging_steps": "1: every optimizer step's metrics are read",
    "disable_tqdm": "console output only",
    "use_cpu": "the CPU audit (the device is a run option, not a knob)",
    "bf16": "precision follows trainer.dtype through model_init_kwargs",
    "fp16": "precision follows trainer.dtype through model_init_kwargs",
    "dataloader_num_workers": "data loading in process: same rows either way",
    "shuffle_dataset": "rows in the rollout's order, so TRL's rows map to rlaudit's "
                       "(row-permutation varies the order instead)",
    "lr_scheduler_type": "constant: the learning rate is rlaudit's actor.optim.lr",
    "warmup_steps": "0: as rlaudit's reference",
    "use_bias_correction_kl": "True, TRL's default: the reference computes TRL's KL under the "
                              "declared convention trl-kl-bias-corrected-k3",
    "log_completions": "console output only",
    "disable_dropout": "True: the tiny models have no dropout; log-probs must be deterministic",
    "use_liger_kernel": "no Liger kernels on CPU (a fused loss of its own: not audited here)",
    "gradient_checkpointing": "memory only (recomputation is exact)",
}

#: keys ``trl_config_kwargs`` maps from rlaudit's config that no scenario or fuzz draw varies
#: for TRL, on purpose: why
UNVARIED = {
    "seed": "trainer.seed: TRL's sampler and dropout are its only consumers here, and the "
            "rollout is fixed (rollout_func), shuffle_dataset False and dropout off",
    "data_seed": "as seed",
    "model_init_kwargs": "the model dtype (trainer.dtype), float64 in every scenario: TRL is "
                         "audited at its declared train_precision's tolerance instead",
    "weight_decay": "the adapter declines weight_decay != 0 (supports: Hugging Face's Trainer "
                    "exempts biases and norms from decay, rlaudit's reference decays every "
                    "parameter)",
}

#: GRPOConfig fields the adapter does not set: why (n/a for the audit)
NOT_SET = {
    # the loss, its normaliser, masks and windows
    "mask_truncated_completions": "n/a: drops truncated completions from the loss; rlaudit's "
                                  "rollouts carry no truncation flag distinct from the length "
                                  "(a response of max length counts as complete)",
    "top_entropy_quantile": "n/a: an entropy-quantile token mask with no rlaudit counterpart "
                            "(only 1.0, every token, is comparable)",
    "off_policy_mask_threshold": "n/a: DeepSeek-V3.2 off-policy sequence masking, no rlaudit "
                                 "counterpart",
    "sapo_temperature_neg": "n/a: loss_type sapo only (not mapped: no rlaudit loss)",
    "sapo_temperature_pos": "n/a: loss_type sapo only",
    "vespo_k_pos": "n/a: loss_type vespo only (not mapped: no rlaudit loss)",
    "vespo_lambda_pos": "n/a: loss_type vespo only",
    "vespo_k_neg": "n/a: loss_type vespo only",
    "vespo_lambda_neg": "n/a: loss_type vespo only",
    "use_adaptive_entropy": "n/a: Skywork-OR1 adaptive entropy coefficient, no rlaudit "
                            "counterpart (entropy_coef is mapped)",
    "entropy_coef_min": "n/a: use_adaptive_entropy only",
    "entropy_coef_max": "n/a: use_adaptive_entropy only",
    "entropy_coef_delta": "n/a: use_adaptive_entropy only",
    "entropy_target": "n/a: use_adaptive_entropy only",
    "router_aux_loss_coef": "n/a: Mixture-of-Experts load-balancing loss; the tiny models are "
                            "dense",
    "cast_lm_head_to_fp32": "n/a: needs an untied LM head; the tiny Qwen2 ties it",
    "generation_batch_size": "n/a: steps_per_generation is set instead (mutually exclusive)",
    "pad_to_multiple_of": "n/a: 'auto' pads only on Neuron; padding columns are varied by "
                          "padding-appended",
    # rewards
    "multi_objective_aggregation": "n/a: 'sum_then_normalize', TRL's default, is the combination "
                                   "rlaudit's reference computes (rlaudit/data/rewards.py); "
                                   "'normalize_then_sum' normalises each function within its "
                                   "group first and whitens the sum over the batch: no rlaudit "
                                   "counterpart",
    # the reference policy
    "sync_ref_model": "n/a: TR-DPO reference syncing; rlaudit's reference policy is fixed",
    "ref_model_mixup_alpha": "n/a: sync_ref_model only",
    "ref_model_sync_steps": "n/a: sync_ref_model only",
    # rollout correction: TRL applies it only to vLLM generations (the adapter declines it)
    "vllm_importance_sampling_correction": "n/a: TRL applies it only with use_vllm=True; the "
                                           "adapter replays fixed rollouts without vLLM and "
                                           "declines actor.rollout_correction",
    "vllm_importance_sampling_mode": "n/a: as vllm_importance_sampling_correction",
    "vllm_importance_sampling_clip_max": "n/a: as vllm_importance_sampling_correction",
    "vllm_importance_sampling_clip_min": "n/a: as vllm_importance_sampling_correction",
    "vllm_importance_sampling_cap": "n/a: as vllm_importance_sampling_correction",
    # generation: the rollout is fixed (rollout_func), so sampling settings do not reach the loss
    **{k: "no effect: generation settings; the rollout is fixed (the adapter's rollout_func)"
       for k in ("top_p", "top_k", "min_p", "generation_kwargs", "chat_template_kwargs",
                 "repetition_penalty", "cache_implementation", "num_generations_eval",
                 "max_tool_calling_iterations", "ds3_gather_for_generation",
                 "use_transformers_continuous_batching",
                 "transformers_continuous_batching_config", "use_transformers_paged")},
    **{k: "no effect: vLLM server settings; no vLLM in the replay"
       for k in ("use_vllm", "vllm_mode", "vllm_model_impl", "vllm_enable_sleep_mode",
                 "vllm_structured_outputs_regex", "vllm_server_base_url", "vllm_server_host",
                 "vllm_server_port", "vllm_server_timeout", "vllm_group_port",
                 "vllm_gpu_memory_utilization", "vllm_max_model_length",
                 "vllm_tensor_parallel_size")},
    **{k: "no effect: logging of completions (console, hub)"
       for k in ("log_multimodal", "num_completions_to_print", "log_unique_prompts",
                 "log_completions_hub_repo")},
    "trust_remote_code": "no effect: the tiny models are plain transformers classes",
}


def not_varied() -> dict[str, str]:
    """Every mapped key no scenario or fuzz draw varies on purpose, with why (fixed values and
    :data:`UNVARIED`)."""
    return {**{k: f"fixed: {v}" for k, v in FIXED.items()}, **UNVARIED}


def trl_knobs_of(config, rows: int, width: int, steps: int, batch=None) -> dict:
    """The GRPOConfig keywords ``trl_config_kwargs`` gives ``config`` on a batch of ``rows`` rows
    and response width ``width`` (the scratch directory left out), with the reward weights of
    ``batch``'s reward functions (one function, weight 1, without a batch); values made
    comparable (dicts and lists as text)."""
    weights = (1.0,) if batch is None else reward_funcs(batch, None)[1]
    kw = trl_config_kwargs(config, rows, width, "<output>", steps, reward_weights=weights)
    kw.pop(OUTPUT_DIR)
    return {k: (repr(v) if isinstance(v, (dict, list)) else v) for k, v in kw.items()}


def docs_block(adapter, scenarios_dir) -> str:
    """docs/targets.md's TRL knob tables (between its ``knob-table:trl`` markers): each mapped
    ``GRPOConfig`` key and what varies it, then each key the adapter does not set and why."""
    from rlaudit.targets.fuzz.coverage import coverage, markdown_rows  # lazy: scenarios, torch

    cov = coverage(adapter, trl_knobs_of, scenarios_dir)
    head = ["| GRPOConfig key | varied by (scenarios; run-level fuzz draws) |", "|---|---|"]
    unset = ["", "| GRPOConfig key not set | why |", "|---|---|"]
    unset += [f"| `{k}` | {why} |" for k, why in sorted(NOT_SET.items())]
    return "\n".join(head + markdown_rows(cov, not_varied()) + unset)
