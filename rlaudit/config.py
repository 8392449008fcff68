"""The algorithm/trainer configuration: nested dataclasses with verl's key names where they exist.

A config file (YAML) mirrors this tree, e.g.::

    algorithm: {adv_estimator: grpo, norm_adv_by_std_in_grpo: true}
    actor: {loss_agg_mode: token-mean, entropy_coeff: 0.0, calculate_entropy: true,
            ppo_mini_batch_size: 4, ppo_micro_batch_size_per_gpu: 2}

:func:`load_config` builds it (:func:`rlaudit.dicts.from_dict`: unknown keys and badly typed
values are rejected with the file and the dotted key) and checks ranges and registry names
(:func:`validate`, through rlaudit.catalogue's cached names: reading a config imports no torch).
Every field has a docstring (the string literal under it) that ``rlaudit list`` and the docs show.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Mapping

from rlaudit import catalogue  # the registries' names, cached: reading a config imports no torch
from rlaudit.config_bounds import check_bounds
from rlaudit.dicts import from_dict, to_dict
from rlaudit.errors import InputError


@dataclass
class OptimConfig:
    name: Literal["adamw", "sgd"] = "adamw"
    """Optimizer. SGD makes fp32 CPU parity comparisons tight (AdamW amplifies tiny grads)."""
    lr: float = 1e-6
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8


@dataclass
class FilterGroupsConfig:
    """DAPO dynamic sampling: drop prompt groups whose metric has zero std."""

    enable: bool = False
    metric: Literal["seq_reward", "seq_final_reward", "acc", "score"] = "seq_final_reward"
    """Per-trajectory metric whose std decides: seq_reward = sum of token-level scores,
    seq_final_reward = sum of token-level rewards (after KL-in-reward), acc/score = the rule score."""
    max_num_gen_batches: int = 10
    """Give up (with a clear error) after this many generation batches; <= 0 means no limit."""


@dataclass
class AlgorithmConfig:
    adv_estimator: str = "grpo"
    """Advantage estimator: gae, grpo, drgrpo, rloo, reinforce_plus_plus, reinforce_plus_plus_baseline."""
    gamma: float = 1.0
    lam: float = 1.0
    norm_adv_by_std_in_grpo: bool = True
    """GRPO: divide by the group's std (False = Dr.GRPO-style mean-centering only)."""
    grpo_std_eps: float = 1e-6
    """GRPO: (score - mean) / (std + grpo_std_eps). verl: 1e-6; TRL: 1e-4 (a convention a
    target declares, rlaudit/targets/contract/declare.py)."""
    outcome_score: Literal["masked-sum", "unmasked-sum"] = "masked-sum"
    """How outcome estimators score a row: the sum of its response-mask-True token rewards, or
    of every position's (verl's token_level_rewards.sum(-1); a declarable convention)."""
    use_kl_in_reward: bool = False
    """token_level_rewards = token_level_scores - kl_coef * KL(old || ref), built out of place."""
    kl_penalty: str = "kl"
    """KL estimator used in the reward: kl/k1, abs, mse/k2, low_var_kl/k3, full."""
    k3_clamp: Literal["value-10", "none"] = "value-10"
    """k3 / low_var_kl (every use: KL in reward, KL loss, rollout KL loss) clamps its per-token
    value at 10 (verl, rlaudit) or not (TRL, textbook k3; a declarable convention)."""
    kl_coef: float = 0.001
    filter_groups: FilterGroupsConfig = field(default_factory=FilterGroupsConfig)


@dataclass
class RolloutCorrectionConfig:
    """Train-vs-rollout mismatch handling (the sampling engine's log-probs vs the trainer's)."""

    rollout_is: Literal["token", "sequence", "geometric"] | None = None
    """Importance weights exp(old_log_probs - rollout_log_probs) per token, per sequence (the
    product over its tokens) or per sequence as their geometric mean (exp of the length-normalised
    log-ratio sum); None = off. verl 0.6.1+ ``rollout_is`` (token, sequence); geometric is verl
    0.6.0's ``rollout_is_level: geometric`` (later verl keeps it for rejection sampling only)."""
    rollout_is_threshold: float = 2.0
    """Upper bound of the weights: truncated to it (TIS) or masked above it (MIS)."""
    rollout_is_mode: Literal["truncate", "mask"] = "truncate"
    """truncate: min(w, threshold) (TIS, verl's only mode since 0.6.1); mask: w = 0 outside
    [rollout_is_threshold_lower, rollout_is_threshold] (verl 0.6.0's ``rollout_is_mode``)."""
    rollout_is_threshold_lower: float | None = None
    """Lower bound of mask mode; None = 1 / rollout_is_threshold (verl's default)."""
    use_rollout_kl_loss: bool = False
    """Add a penalty on current-vs-rollout log-prob drift (SkyRL's rollout KL loss)."""
    rollout_kl_loss_coef: float = 0.001
    rollout_kl_loss_type: str = "k2"
    """k1, abs, k2/mse, k3/low_var_kl."""


@dataclass
class DistillConfig:
    enable: bool = False
    loss_type: str = "forward_kl_topk"
    """forward_kl_topk (teacher's top-k log-probs) or k3 (teacher log-prob of the sampled token)."""
    coef: float = 1.0


@dataclass
class ActorConfig:
    loss_mode: str = "vanilla"
    """Policy loss: vanilla (PPO clip, asymmetric + dual clip), gspo, cispo."""
    gspo_gradient: Literal["per-token", "sequence"] = "per-token"
    """gspo: GSPO-token's gradient (each token's term differentiates its own log-prob: verl,
    rlaudit) or GSPO's sequence-level one (through the sequence mean: slime, TRL; a declarable
    convention). Same values either way."""
    loss_agg_mode: str = "token-mean"
    """token-mean, seq-mean-token-sum, seq-mean-token-mean, seq-mean-token-sum-norm."""
    loss_scale_factor: float | None = None
    """seq-mean-token-sum-norm divides each sequence's token sum by this (None = response width R
    of the whole batch, a constant across micro-batches)."""
    loss_seq_count: Literal["valid-rows", "all-rows"] = "valid-rows"
    """N_seq of the seq-mean modes: rows with at least one valid token (rlaudit, verl), or every
    row, empty ones included (SkyRL, slime, TRL's grpo/dr_grpo; a declarable convention)."""
    loss_token_denominator: Literal["minibatch", "batch-mean"] = "minibatch"
    """N_tok of token-mean: the mini-batch's valid tokens, or the whole training batch's divided
    by the number of mini-batches per epoch (TRL's dapo normaliser; a declarable convention)."""
    clip_ratio: float = 0.2
    clip_ratio_low: float | None = None
    """Lower clip epsilon; None = clip_ratio."""
    clip_ratio_high: float | None = None
    """Upper clip epsilon; None = clip_ratio."""
    clip_ratio_c: float = 3.0
    """Dual-clip bound for negative advantages (must be > 1)."""
    entropy_coeff: float = 0.0
    """Weight of -entropy in the loss. Entropy is *computed* when this is non-zero or
    calculate_entropy is true, and then always logged as actor/entropy."""
    calculate_entropy: bool = False
    """Compute and log entropy even when entropy_coeff is 0 (verl PR #6016)."""
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.001
    kl_loss_type: str = "low_var_kl"
    kl_loss_weight: Literal["none", "ratio"] = "none"
    """What the KL loss term is multiplied by per token: nothing (verl, rlaudit), or the
    differentiable importance ratio pi / pi_old at the loss's level (TRL's default
    use_bias_correction_kl: rlaudit.algo.policy_loss.importance_ratio; a declarable
    convention)."""
    ppo_mini_batch_size: int = 4
    """Prompts per optimizer step (multiplied by rollout.n, as in verl)."""
    ppo_micro_batch_size_per_gpu: int = 2
    """Trajectories per forward/backward on each data-parallel rank (when not use_dynamic_bsz)."""
    use_dynamic_bsz: bool = False
    """Cut micro-batches by token budget instead of by count."""
    ppo_max_token_len_per_gpu: int = 16384
    """Token budget (prompt + response tokens) of one micro-batch when use_dynamic_bsz."""
    ppo_epochs: int = 1
    shuffle: bool = False
    context_parallel_size: int = 1
    """Context-parallel ranks each sequence's tokens are divided over in the actor update (verl:
    ``actor.megatron.context_parallel_size``). rlaudit's backends simulate the CP group in the
    shared update step (load-balanced 2*cp chunk split, partial gradients summed over the group,
    rlaudit/update/context_parallel.py); the result must not depend on it."""
    grad_clip: float = 1.0
    """Clip the global grad norm to this; <= 0 disables clipping (the norm is still logged)."""
    logprob_chunk_size: int = 256
    """Rows of logits processed at once by the chunked log-prob/entropy (extra memory ~ 1.25 x
    chunk x vocab x 4 bytes; see benchmarks/logprob_entropy.py)."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)
    distill: DistillConfig = field(default_factory=DistillConfig)


@dataclass
class CriticConfig:
    cliprange_value: float = 0.5
    loss_agg_mode: str = "token-mean"
    ppo_micro_batch_size_per_gpu: int = 2
    ppo_epochs: int = 1
    grad_clip: float = 1.0
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-5))


@dataclass
class RolloutConfig:
    n: int = 4
    """Responses sampled per prompt."""
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    """-1 = off."""
    response_length: int = 32
    """Maximum response tokens."""
    prompt_length: int = 64


@dataclass
class OverlongBufferConfig:
    """DAPO overlong penalty: min(-(len - (max_len - buffer_len)) / buffer_len * factor, 0)."""

    enable: bool = False
    len: int = 8
    penalty_factor: float = 1.0


@dataclass
class RewardConfig:
    overlong_buffer: OverlongBufferConfig = field(default_factory=OverlongBufferConfig)


@dataclass
class DataConfig:
    train_batch_size: int = 4
    """Prompts per training step (after filtering)."""
    gen_batch_size: int | None = None
    """Prompts per generation batch (None = train_batch_size)."""


@dataclass
class TrainerConfig:
    seed: int = 0
    total_steps: int = 1
    dtype: Literal["float32", "float64", "bfloat16"] = "float32"
    balance_batch: bool = False
    """Reorder trajectories so data-parallel ranks get similar token counts."""
    extra_padding_microbatches: int = 0
    """Audit knob: append this many padding micro-batches (response_mask all False) to every
    optimizer step on every rank. A correct update is unchanged by them."""
    metric_reduction: Literal["contribution", "microbatch-mean"] = "contribution"
    """How loss-term metrics (reduction "global" in rlaudit/metrics.py) are reduced:
    "contribution" (rlaudit's: the global mini-batch value, averaged over optimizer steps) or
    "microbatch-mean" (each real micro-batch's own local value, averaged over every micro-batch
    of every rank and optimizer step of the training step: verl's AggregationType.MEAN, TRL).
    The loss and the update are the same either way. Set by ``rlaudit run --target`` for a
    target that declares ``metric_reduction = "microbatch-mean"``."""
    metric_reduction_except: tuple[str, ...] = ()
    """Metric names reduced the *other* way than ``metric_reduction`` (a target logging, say,
    its loss as a contribution and its clip fractions as micro-batch means)."""

    def metric_mode(self, name: str) -> str:
        """How metric ``name`` is reduced: "contribution" or "microbatch-mean"."""
        if name in self.metric_reduction_except:
            return "contribution" if self.metric_reduction == "microbatch-mean" else \
                "microbatch-mean"
        return self.metric_reduction


@dataclass
class Config:
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    data: DataConfig = field(default_factory=DataConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)

    @property
    def use_critic(self) -> bool:
        return self.algorithm.adv_estimator == "gae"

    @property
    def compute_entropy(self) -> bool:
        """docs/findings.md, seeds: entropy is computed when either knob asks for it."""
        return self.actor.calculate_entropy or self.actor.entropy_coeff != 0


def replayed_dict(cfg: Config) -> dict[str, Any]:
    """``to_dict(cfg)`` less what no replay reads: the ``critic`` section when no critic is used
    (rlaudit/update/step.py and every backend build and read a critic only for gae). Two configs
    with the same replayed_dict replay alike (rlaudit/backends/dedupe.py, the degenerate-variant
    check of rlaudit/scenarios/variants.py)."""
    out = to_dict(cfg)
    if not cfg.use_critic:
        out.pop("critic", None)
    return out


def load_config(data: Mapping[str, Any] | None, *, source: str | None = None,
                prefix: str = "") -> Config:
    """Build and fully validate a :class:`Config` (types, ranges, registry names)."""
    cfg = from_dict(Config, data, source=source, prefix=prefix)
    validate(cfg, source=source, prefix=prefix)
    return cfg


def validate(cfg: Config, *, source: str | None = None, prefix: str = "") -> None:
    """Range checks and registry names. The names come from rlaudit.catalogue, so that reading a
    config needs no torch."""
    def bad(key, msg):
        raise InputError(msg, source=source, key=f"{prefix}{key}")

    check_bounds(cfg, source=source, prefix=prefix)  # every number: finite and in its range
    a, act = cfg.algorithm, cfg.actor
    for key, v in (("actor.ppo_mini_batch_size", act.ppo_mini_batch_size),
                   ("actor.ppo_micro_batch_size_per_gpu", act.ppo_micro_batch_size_per_gpu),
                   ("actor.ppo_epochs", act.ppo_epochs),
                   ("actor.ppo_max_token_len_per_gpu", act.ppo_max_token_len_per_gpu),
                   ("actor.logprob_chunk_size", act.logprob_chunk_size),
                   ("actor.context_parallel_size", act.context_parallel_size),
                   ("critic.ppo_micro_batch_size_per_gpu", cfg.critic.ppo_micro_batch_size_per_gpu),
                   ("critic.ppo_epochs", cfg.critic.ppo_epochs),
                   ("rollout.n", cfg.rollout.n), ("rollout.response_length", cfg.rollout.response_length),
                   ("data.train_batch_size", cfg.data.train_batch_size),
                   ):
        if v < 1:
            bad(key, f"must be >= 1, got {v}")
    if cfg.trainer.extra_padding_microbatches < 0:
        bad("trainer.extra_padding_microbatches", "must be >= 0")
    if cfg.rollout.temperature <= 0:
        bad("rollout.temperature", f"must be > 0, got {cfg.rollout.temperature}")
    if not 0 < cfg.rollout.top_p <= 1:
        bad("rollout.top_p", f"must be in (0, 1], got {cfg.rollout.top_p}")
    if act.clip_ratio_c <= 1:
        bad("actor.clip_ratio_c", f"dual-clip bound must be > 1, got {act.clip_ratio_c}")
    for key, v in (("actor.clip_ratio", act.clip_ratio), ("actor.clip_ratio_low", act.clip_ratio_low),
                   ("actor.clip_ratio_high", act.clip_ratio_high)):
        if v is not None and v < 0:
            bad(key, f"must be >= 0, got {v}")
    if act.loss_scale_factor is not None and act.loss_scale_factor <= 0:
        bad("actor.loss_scale_factor", f"must be > 0, got {act.loss_scale_factor}")
    rc = act.rollout_correction
    if rc.rollout_is_threshold <= 0:
        bad("actor.rollout_correction.rollout_is_threshold",
            f"must be > 0, got {rc.rollout_is_threshold}")
    if rc.rollout_is_threshold_lower is not None and not (
            0 < rc.rollout_is_threshold_lower <= rc.rollout_is_threshold):
        bad("actor.rollout_correction.rollout_is_threshold_lower",
            f"must be in (0, rollout_is_threshold = {rc.rollout_is_threshold}], got "
            f"{rc.rollout_is_threshold_lower}")
    if a.gamma < 0 or a.gamma > 1 or a.lam < 0 or a.lam > 1:
        bad("algorithm.gamma", "gamma and lam must be in [0, 1]")
    if cfg.data.gen_batch_size is not None and cfg.data.gen_batch_size < cfg.data.train_batch_size:
        bad("data.gen_batch_size", "must be >= data.train_batch_size")

    names = catalogue.algo_names()
    checks = (
        ("algorithm.adv_estimator", a.adv_estimator, names.ADV_ESTIMATORS),
        ("algorithm.kl_penalty", a.kl_penalty, names.KL_ESTIMATORS),
        ("actor.loss_mode", act.loss_mode, names.POLICY_LOSSES),
        ("actor.loss_agg_mode", act.loss_agg_mode, names.AGG_MODES),
        ("actor.kl_loss_type", act.kl_loss_type, names.KL_ESTIMATORS),
        ("actor.rollout_correction.rollout_kl_loss_type",
         act.rollout_correction.rollout_kl_loss_type, names.KL_ESTIMATORS),
        ("actor.distill.loss_type", act.distill.loss_type, names.DISTILL_LOSSES),
        ("critic.loss_agg_mode", cfg.critic.loss_agg_mode, names.AGG_MODES),
    )
    for key, value, registry in checks:
        registry.get(value, source=source, key=f"{prefix}{key}")
