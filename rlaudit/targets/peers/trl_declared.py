"""What the TRL adapter declares (docs/peers.md, "TRL"): the conventions rlaudit's reference
computes under for TRL, the differences that remain, and links to the lines of TRL's
``grpo_trainer.py`` they come from at each pinned tag.
"""

from __future__ import annotations

from rlaudit.algo.kl import KL_ESTIMATORS
from rlaudit.targets.contract.declare import Difference

TRL_ORIGIN = "https://github.com/huggingface/trl/blob/v{v}/trl/trainer/grpo_trainer.py"


#: line numbers of the cited code in grpo_trainer.py at each audited tag (1.0.0 and 1.5.1 have
#: no entropy bonus: :func:`entropy_bonus_link` cites the newest tag for them)
_LINES = {"1.16.0": {"eps": 2787, "grpo": 3154, "dr_grpo": 3164, "dapo": 3170, "luspo": 3179,
                     "entropy_bonus": 3199, "metric": 3259, "num_items": 2498,
                     "kl": 3100, "sequence": 3087},
          "1.14.2": {"eps": 2853, "grpo": 3225, "dr_grpo": 3235, "dapo": 3241, "luspo": 3250,
                     "entropy_bonus": 3270, "metric": 3330, "num_items": 2560,
                     "kl": 3171, "sequence": 3158},
          "1.9.2": {"eps": 2707, "grpo": 3125, "dr_grpo": 3135, "dapo": 3141, "luspo": 3148,
                    "entropy_bonus": 3171, "metric": 3232, "num_items": 2427, "kl": 3071,
                    "sequence": 3058},
          "1.5.1": {"eps": 2167, "grpo": 2567, "dr_grpo": 2575, "dapo": 2579, "luspo": 2583,
                    "metric": 2592, "num_items": 1772, "kl": 2513, "sequence": 2500},
          "1.0.0": {"eps": 1989, "grpo": 2389, "dr_grpo": 2397, "dapo": 2401, "luspo": 2405,
                    "metric": 2414, "num_items": 1660, "kl": 2335, "sequence": 2322}}


#: TRL's deliberate choices that rlaudit's reference computes too, declared as conventions:
#: (name, reason, cited line, convention). Every variant of a scenario run against TRL is
#: replayed by the reference under them, so the checks stay strict. docs/peers.md, "TRL".
CONVENTIONS = (
    ("trl-grpo-std-eps",
     "scale_rewards='group' divides by (group std + 1e-4); verl and rlaudit by (std + 1e-6)",
     "eps", {"grpo_std_eps": 1e-4}),
    ("trl-seq-mean-over-every-completion",
     "loss_type grpo / dr_grpo / luspo take each micro-batch's mean over its completions (a "
     "completion with no trained token counts, with loss 0) and divide by "
     "gradient_accumulation_steps; micro-batches have equal row counts, so the optimizer step's "
     "loss is the sequence mean over every row of the mini-batch",
     "grpo", {"seq_count": "all-rows"}),
    ("trl-dapo-generation-token-normaliser",
     "loss_type dapo divides each micro-batch's token sum by num_items_in_batch (the generation "
     "batch's trained tokens) x gradient_accumulation_steps / steps_per_generation: the batch's "
     "tokens / its mini-batches, not the optimizer step's own token count",
     "dapo", {"token_denominator": "batch-mean"}),
    ("trl-kl-bias-corrected-k3",
     "beta > 0 adds beta x k3 per token before the loss aggregation, k3 = exp(ref - logp) - "
     "(ref - logp) - 1 without a clamp of its value, multiplied by the differentiable importance "
     "ratio (use_bias_correction_kl, TRL's default: DeepSeek-V3.2's unbiased reverse-KL "
     "gradient; at the sequence level for GSPO)",
     "kl", {"k3_clamp": "none", "kl_loss_weight": "ratio"}),
    ("trl-gspo-sequence-gradient",
     "importance_sampling_level='sequence' (GSPO) takes exp of the sequence's mean log-ratio "
     "and differentiates through that mean (GSPO's sequence-level objective), not per token "
     "(GSPO-token, verl)", "sequence", {"gspo_gradient": "sequence"}),
)


#: what remains a declared difference (reported "differs"), each narrowed to the problems it
#: explains: (name, reason, cited line, checks, cases): a metric TRL has no value for under some
#: loss types. (A clip status decided by float32 rounding -- TRL's advantage 0 where the float64
#: reference has -1.5e-8 -- was declared here; the run-level noise floor now allows it for any
#: float32 trainer: rlaudit.verdict.compare._undecided_tokens.)
DIFFERENCES = (
    ("trl-entropy-logged-as-token-mean",
     "TRL logs entropy as each micro-batch's token mean whatever its loss_type; rlaudit's "
     "actor/entropy is aggregated like the loss, so under the sequence-mean loss types (grpo, "
     "dr_grpo, luspo) the adapter does not report it (the entropy values themselves are "
     "compared per token: TrainStepOutput.entropy)",
     "metric", ("backend-parity",),
     ("metric actor/entropy missing", "only in one run ['actor/entropy']")),
    ("trl-no-policy-loss-with-kl",
     "with beta > 0 TRL's loss is the policy loss plus beta x its KL term and TRL logs no "
     "policy loss of its own, so the adapter reports no actor/pg_loss where use_kl_loss is on "
     "(actor/loss and actor/kl_loss are compared there)",
     "kl", ("backend-parity",),
     ("metric actor/pg_loss missing", "only in one run ['actor/pg_loss']")),
)


def declared_differences(version: str) -> tuple:
    """:data:`CONVENTIONS` as the API's ``Difference`` objects with their reference convention
    (the run level computes every variant under them: ``checks`` is every check), then
    :data:`DIFFERENCES`; each linked to the code it comes from at the pinned tag."""
    lines = _LINES.get(version, _LINES["1.16.0"])
    at = TRL_ORIGIN.format(v=version if version in _LINES else "1.16.0") + "#L{}"
    return tuple(Difference(name, reason=reason, link=at.format(lines[key]), checks=("*",),
                            convention=convention)
                 for name, reason, key, convention in CONVENTIONS) + tuple(
        Difference(name, reason=reason, link=at.format(lines[key]), checks=checks, cases=cases)
        for name, reason, key, checks, cases in DIFFERENCES)


def canonical_kl(name: str) -> str:
    """``name``'s primary name; an unknown one as it is (the config's own check names it)."""
    return KL_ESTIMATORS.canonical(name) if name in KL_ESTIMATORS else name


def kl_link(version: str) -> str:
    lines = _LINES.get(version, _LINES["1.16.0"])
    return TRL_ORIGIN.format(v=version if version in _LINES else "1.16.0") + f"#L{lines['kl']}"


def entropy_bonus_link(version: str) -> str:
    if "entropy_bonus" not in _LINES.get(version, {}):
        version = "1.16.0"
    return TRL_ORIGIN.format(v=version) + f"#L{_LINES[version]['entropy_bonus']}"
