"""verl's trainer-config keys under ``actor_rollout_ref.actor`` and ``algorithm``, each accounted
for against what the verl adapter's ``train_step`` (verl >= 0.9, its FSDP engine:
``verl_train.verl_overrides``) sets: mapped from rlaudit's config (the knob table of
docs/targets.md says which scenarios and fuzz draws vary each, or, :data:`UNVARIED`, why none
does), set to one value (:data:`FIXED`, with the reason), or not set (:data:`NOT_SET`, by exact
key or by a prefix ending in ``.``: n/a with the reason; those that change a loss, normaliser,
mask, window or logged metric say what rlaudit would need to vary them).
``tests/targets/peers/test_verl_knobs.py`` fails on a key of the installed release's generated
trainer config that is in none of them, and on a mapped key that nothing varies.
"""

from __future__ import annotations

from rlaudit.targets.peers.verl_train import rows_unsupported, verl_overrides

ACTOR = "actor_rollout_ref.actor."
ROLLOUT = "actor_rollout_ref.rollout."
MODEL = "actor_rollout_ref.model."
#: the sections of verl's trainer config the table accounts for
SECTIONS = (ACTOR, "algorithm.")
#: stands for the scenario's model snapshot (a path, not a knob)
MODEL_PATH = "<model>"

#: keys ``verl_overrides`` sets to one value whatever the config: why
FIXED = {
    "trainer.device": "the CPU audit (the device is a run option, not a knob)",
    "trainer.n_gpus_per_node": "the column's data-parallel size (1; 2 on verl-fsdp-dp2, "
                               "verl_dp.py): a layout, not a config knob",
    "trainer.nnodes": "one node",
    f"{MODEL}path": "the scenario's model snapshot",
    f"{MODEL}use_remove_padding": "True: verl's packed (padding-free) forward, the engine "
                                  "path of every verl release audited",
    f"{MODEL}enable_gradient_checkpointing": "memory only (recomputation is exact)",
    f"{MODEL}override_config": "sdpa attention: the CPU has no flash-attention",
    f"{ACTOR}strategy": "fsdp2, the engine driven on CPU",
    f"{ACTOR}fsdp_config.strategy": "fsdp2, as actor.strategy",
    f"{ACTOR}fsdp_config.dtype": "float32, verl's widest training dtype: the adapter declares "
                                 "train_precision float32 and is compared at its tolerances",
    f"{ACTOR}fsdp_config.model_dtype": "fp32, as fsdp_config.dtype",
    f"{ACTOR}fsdp_config.mixed_precision": "fp32 everywhere, as fsdp_config.dtype",
    f"{ACTOR}fsdp_config.use_torch_compile": "no torch.compile on the CPU audit (numerics "
                                             "unchanged)",
    f"{ACTOR}use_torch_compile": "as fsdp_config.use_torch_compile",
    f"{ACTOR}shuffle": "False: the adapter declines actor.shuffle (verl shuffles with its own "
                       "seed per rank: rows cannot be matched to rlaudit's)",
    "algorithm.kl_ctrl.type": "the fixed controller: rlaudit's KL-in-reward coefficient is a "
                              "constant (algorithm.kl_coef, mapped to kl_ctrl.kl_coef)",
    "algorithm.rollout_correction.rollout_rs": "None: rejection sampling drops tokens from "
                                               "response_mask; no rlaudit counterpart",
    "algorithm.rollout_correction.rollout_rs_threshold": "None: rollout_rs only",
    "algorithm.rollout_correction.bypass_mode": "False: decoupled mode (old log-probs "
                                                "recomputed), as rlaudit's reference",
    "algorithm.rollout_correction.rollout_is_batch_normalize": "False: no rlaudit counterpart "
                                                               "(weights rescaled to mean 1)",
    **{f"actor_rollout_ref.ref.{k}": "the reference worker's engine as the actor's (float32 "
                                     "FSDP2 on the CPU audit; verl_kl.reference_overrides "
                                     "says why)"
       for k in ("fsdp_config.strategy",
                 "fsdp_config.dtype", "fsdp_config.model_dtype", "fsdp_config.mixed_precision",
                 "fsdp_config.use_torch_compile", "fsdp_config.forward_only", "optim")},
}

#: keys ``verl_overrides`` maps from rlaudit's config that no scenario or fuzz draw varies for
#: verl, on purpose: why
UNVARIED = {
    f"{ACTOR}clip_ratio": "unread: the adapter always sets clip_ratio_low and clip_ratio_high "
                          "(varied), which verl reads instead of clip_ratio when they are set",
    "algorithm.lam": "unread: only GAE reads lam, and the adapter declines GAE (no critic)",
}

_SCHEDULE = ("n/a: learning-rate schedule; left at verl's constant rate without warmup, which "
             "is rlaudit's reference (it has no schedule)")
_ENGINE = ("no effect: FSDP engine memory and sharding (one rank, float32: same numbers either "
           "way)")
_QAT = "n/a: quantisation-aware training, off (no rlaudit counterpart)"

#: keys of verl's config under SECTIONS the adapter does not set: why (a key ending in "." covers
#: every key under it)
NOT_SET = {
    # the loss and its normaliser
    f"{ACTOR}tau_pos": "n/a: loss_mode sapo only (not mapped: no rlaudit loss)",
    f"{ACTOR}tau_neg": "n/a: loss_mode sapo only",
    f"{ACTOR}policy_loss.clip_cov_ratio": "n/a: loss_mode clip_cov only (not mapped: no rlaudit "
                                          "loss)",
    f"{ACTOR}policy_loss.clip_cov_lb": "n/a: loss_mode clip_cov only",
    f"{ACTOR}policy_loss.clip_cov_ub": "n/a: loss_mode clip_cov only",
    f"{ACTOR}policy_loss.kl_cov_ratio": "n/a: loss_mode kl_cov only (not mapped: no rlaudit "
                                        "loss)",
    f"{ACTOR}policy_loss.ppo_kl_coef": "n/a: loss_mode kl_cov only",
    f"{ACTOR}policy_loss.dro_beta": "n/a: loss_mode dro only (not mapped: no rlaudit loss)",
    f"{ACTOR}calculate_sum_pi_squared": "n/a: only the optimal-token-baseline estimators read "
                                        "it (not mapped: no rlaudit estimator)",
    f"{ACTOR}grad_clip": "the engine clips with optim.clip_grad (mapped, varied); this "
                         "actor-level key is the legacy worker's",
    # windows, masks, micro-batching
    f"{ACTOR}rollout_n": "interpolated from rollout.n (mapped, varied)",
    f"{ACTOR}ppo_micro_batch_size": "deprecated global micro-batch size: "
                                    "ppo_micro_batch_size_per_gpu is set instead (varied)",
    f"{ACTOR}use_remove_padding": "interpolated from model.use_remove_padding (fixed: True)",
    f"{ACTOR}ulysses_sequence_parallel_size": "n/a: Ulysses sequence parallelism needs more "
                                              "than one rank per sequence; the adapter runs "
                                              "one rank (context parallelism is not mapped for "
                                              "verl)",
    f"{ACTOR}pad_to_length": "no effect on the math: pads packed micro-batches to a static "
                             "token count (padding columns are varied by padding-appended)",
    f"{ACTOR}use_prefix_grouper": "n/a: a shared-prefix forward (an optimisation with no "
                                  "rlaudit counterpart), off",
    f"{ACTOR}data_loader_seed": "unread: shuffle is False (declined)",
    f"{ACTOR}freeze_vision_tower": "n/a: the tiny models have no vision tower",
    # numerics-preserving engine settings
    f"{ACTOR}entropy_from_logits_with_chunking": "no effect: entropy computed in chunks "
                                                 "(memory)",
    f"{ACTOR}entropy_from_logits_chunk_size": "no effect: as entropy_from_logits_with_chunking",
    f"{ACTOR}entropy_checkpointing": "no effect: recomputation is exact",
    f"{ACTOR}use_fused_kernels": "n/a: fused GPU kernels (interpolated from model."
                                 "use_fused_kernels, off); no CPU build",
    f"{ACTOR}fsdp_config.": _ENGINE,
    f"{ACTOR}fsdp_config.qat.": _QAT,
    f"{ACTOR}fsdp_config.turbo_config.": "n/a: the turbo engine's parallel plan (not the "
                                         "engine driven here)",
    f"{ACTOR}fsdp_config.ulysses_sequence_parallel_size": "n/a: as actor."
                                                          "ulysses_sequence_parallel_size",
    f"{ACTOR}fsdp_config.pad_to_length": "no effect on the math: as actor.pad_to_length",
    f"{ACTOR}fsdp_config.pad_to_length_bucket": "no effect on the math: as actor.pad_to_length",
    f"{ACTOR}qat.": _QAT,
    f"{ACTOR}optim.optimizer_impl": "torch.optim: the class named by optim.optimizer (mapped, "
                                    "varied)",
    **{f"{ACTOR}optim.{k}": _SCHEDULE
       for k in ("lr_warmup_steps_ratio", "total_training_steps", "lr_warmup_steps",
                 "min_lr_ratio", "num_cycles", "lr_scheduler_type", "zero_indexed_step",
                 "warmup_style")},
    f"{ACTOR}checkpoint.": "no effect: checkpoint contents and saving",
    f"{ACTOR}profiler.": "no effect: profiling",
    # algorithm
    "algorithm.kl_ctrl.": "unread: the adaptive controller's (kl_ctrl.type is fixed)",
    "algorithm.rollout_correction.": "unread: bypass mode's policy loss (bypass_mode is fixed "
                                     "False)",
    "algorithm.filter_groups.": "n/a: DAPO's group filter runs in the recipe's fit loop, before "
                                "this step; rlaudit hands verl the rows its reference keeps "
                                "(filter_groups is audited as a stage)",
    "algorithm.use_pf_ppo": "n/a: PF-PPO reweights or resamples rows before the update; no "
                            "rlaudit counterpart, off",
    "algorithm.pf_ppo.": "unread: use_pf_ppo is False",
}


def not_varied() -> dict[str, str]:
    """Every mapped key no scenario or fuzz draw varies on purpose, with why."""
    return {**{k: f"fixed: {v}" for k, v in FIXED.items()}, **UNVARIED}


def verl_knobs_of(config, rows: int, width: int, steps: int, batch=None) -> dict:
    """The verl trainer-config keys ``verl_overrides`` gives ``config`` on a batch of ``rows``
    rows (one data-parallel rank, as the adapter runs); values made comparable (dicts and lists
    as text). ValueError for a batch verl cannot cut into its mini-batches (the adapter's
    train_step refuses it: not run there either)."""
    why = rows_unsupported(config, rows, 1)
    if why:
        raise ValueError(why)
    kw = verl_overrides(config, model_path=MODEL_PATH, dp=1, rows=rows)
    return {k: (repr(v) if isinstance(v, (dict, list)) else v) for k, v in kw.items()}


def not_set_reason(key: str) -> str | None:
    """Why ``key`` is not set (:data:`NOT_SET`: the exact key, else its longest prefix entry)."""
    if key in NOT_SET:
        return NOT_SET[key]
    prefixes = [p for p in NOT_SET if p.endswith(".") and key.startswith(p)]
    return NOT_SET[max(prefixes, key=len)] if prefixes else None


def config_keys(generated: dict) -> list[str]:
    """The dotted keys of verl's generated trainer config (the YAML's parsed tree) under
    :data:`SECTIONS`, leaves only, ``_target_`` (a class name) left out."""
    out = []

    def walk(node, prefix):
        for k, v in node.items():
            if k == "_target_":
                continue
            if isinstance(v, dict) and v:
                walk(v, f"{prefix}{k}.")
            else:
                out.append(f"{prefix}{k}")

    walk(generated.get("actor_rollout_ref", {}).get("actor", {}), ACTOR)
    walk(generated.get("algorithm", {}), "algorithm.")
    return sorted(out)


def docs_block(adapter, scenarios_dir) -> str:
    """docs/targets.md's verl knob tables (between its ``knob-table:verl`` markers): each key
    the FSDP engine's train_step maps and what varies it, then each key of verl's actor and
    algorithm config it does not set and why."""
    from rlaudit.targets.fuzz.coverage import coverage, markdown_rows  # lazy: scenarios, torch

    cov = coverage(adapter, verl_knobs_of, scenarios_dir)
    head = ["| verl config key | varied by (scenarios; run-level fuzz draws) |", "|---|---|"]
    unset = ["", "| verl config key not set (`.` ends a group) | why |", "|---|---|"]
    unset += [f"| `{k}` | {why} |" for k, why in sorted(NOT_SET.items())]
    return "\n".join(head + markdown_rows(cov, not_varied()) + unset)
