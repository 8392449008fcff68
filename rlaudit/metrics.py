"""The one catalogue of metric names (verl's names), used by the trainer, every backend, the
goldens, MLflow and the invariants alike.

Every metric a step reports must be listed here (``check_known`` enforces it), with how it is
reduced and the bounds a correct value lies in (the sanity-bound invariants read them).

Reduction conventions (the denominators are where most metric bugs live):

- ``global``: computed over the whole mini-batch as one batch would be — every micro-batch and
  data-parallel rank contributes ``numerator / global denominator``, contributions are summed
  (never a mean of micro-batch or rank means). Averaged over the optimizer steps of a training
  step with equal weight per optimizer step.
- ``batch``: computed once over the whole training batch (rollout statistics, advantages).
- ``step``: one value per optimizer step (grad norm, lr), averaged over the step's optimizer steps.
- ``timing``: wall-clock; never compared against goldens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable

INF = math.inf


@dataclass(frozen=True)
class MetricSpec:
    name: str
    doc: str
    reduction: str = "global"          # global | batch | step | timing
    low: float = -INF                  # sanity bounds a correct value lies in
    high: float = INF
    golden: bool = True                # compared against golden values
    #: "" varies continuously; "count": a fraction of counted tokens or rows (moves by whole
    #: counts); "signed": a fraction of tokens counted only where the advantage is nonzero (the
    #: policy clip fractions: a ratio outside the clip range counts for A > 0 or A < 0, not A = 0)
    counted: str = ""


_SPECS: list[MetricSpec] = [
    # ---- actor update --------------------------------------------------------------------------
    MetricSpec("actor/pg_loss", "policy-gradient loss, aggregated with actor.loss_agg_mode"),
    MetricSpec("actor/pg_clipfrac", "fraction of tokens whose ratio was clipped (token-mean)",
               low=0, high=1, counted="signed"),
    MetricSpec("actor/pg_clipfrac_lower", "fraction of tokens hit by the dual clip (token-mean)",
               low=0, high=1, counted="signed"),
    MetricSpec("actor/pg_clipfrac_undecided", "bookkeeping: the share of tokens (token-mean) "
               "whose clip flag rounding decides (a ratio within CLIP_UNDECIDED_RTOL of a clip "
               "bound, or an advantage within CLIP_UNDECIDED_ATOL of 0 outside the clip band): "
               "a correct trainer in another precision may clip each either way",
               low=0, high=1, golden=False),
    MetricSpec("actor/ppo_kl", "token-mean of old_log_prob - log_prob (k1, policy drift)"),
    MetricSpec("actor/entropy", "policy entropy, aggregated with actor.loss_agg_mode; logged "
               "whenever entropy is computed (calculate_entropy or entropy_coeff != 0)", low=0),
    MetricSpec("actor/kl_loss", "KL(policy || reference) loss term, actor.kl_loss_type, "
               "aggregated with loss_agg_mode"),
    MetricSpec("actor/kl_coef", "actor.kl_loss_coef", reduction="step"),
    MetricSpec("actor/rollout_kl", "train-vs-rollout log-prob drift loss term (rollout KL loss)"),
    MetricSpec("actor/distill_loss", "distillation loss term"),
    MetricSpec("actor/loss", "total actor loss: pg_loss - entropy_coeff*entropy + kl terms"),
    MetricSpec("actor/grad_norm", "global L2 norm of the actor gradient before clipping",
               reduction="step", low=0),
    MetricSpec("actor/lr", "actor learning rate", reduction="step", low=0),
    MetricSpec("actor/num_microbatches", "forward/backward passes per rank per optimizer step "
               "(padding micro-batches included)", reduction="step", low=1, golden=False),
    # ---- critic update -------------------------------------------------------------------------
    MetricSpec("critic/vf_loss", "clipped value loss, aggregated with critic.loss_agg_mode", low=0),
    MetricSpec("critic/vf_clipfrac", "fraction of tokens where the clipped value loss was larger",
               low=0, high=1, counted="count"),
    MetricSpec("critic/vpred_mean", "token-mean of the critic's predictions during the update"),
    MetricSpec("critic/grad_norm", "global L2 norm of the critic gradient before clipping",
               reduction="step", low=0),
    MetricSpec("critic/lr", "critic learning rate", reduction="step", low=0),
    # ---- batch statistics (verl's compute_data_metrics) -----------------------------------------
    MetricSpec("critic/score/mean", "mean over trajectories of the sequence score", "batch"),
    MetricSpec("critic/score/max", "max sequence score", "batch"),
    MetricSpec("critic/score/min", "min sequence score", "batch"),
    MetricSpec("critic/rewards/mean", "mean over trajectories of the summed token-level rewards",
               "batch"),
    MetricSpec("critic/advantages/mean", "token-mean of advantages", "batch"),
    MetricSpec("critic/advantages/max", "max advantage over valid tokens", "batch"),
    MetricSpec("critic/advantages/min", "min advantage over valid tokens", "batch"),
    MetricSpec("critic/returns/mean", "token-mean of returns", "batch"),
    MetricSpec("critic/values/mean", "token-mean of values (GAE only)", "batch"),
    MetricSpec("response_length/mean", "mean response length (tokens)", "batch", low=0),
    MetricSpec("response_length/max", "max response length", "batch", low=0),
    MetricSpec("response_length/min", "min response length", "batch", low=0),
    MetricSpec("response_length/clip_ratio", "fraction of responses that hit the length limit",
               "batch", low=0, high=1, counted="count"),
    MetricSpec("prompt_length/mean", "mean prompt length (tokens)", "batch", low=0),
    # ---- rollout / reward shaping --------------------------------------------------------------
    MetricSpec("rollout/kl", "token-mean of the stored KL(old || ref) used for KL-in-reward; "
               "must equal the KL before reward shaping (slime PR #2114)", "batch"),
    MetricSpec("actor/reward_kl_penalty", "token-mean of kl_coef * KL subtracted from rewards",
               "batch"),
    MetricSpec("rollout_corr/is_weight_mean", "token-mean of the (truncated) rollout IS weight",
               "batch", low=0),
    MetricSpec("rollout_corr/is_clipfrac", "fraction of tokens (or sequences) whose IS weight was "
               "truncated", "batch", low=0, high=1, counted="count"),
    MetricSpec("rollout_corr/kl", "token-mean of rollout_log_prob - old_log_prob (k1)", "batch"),
    MetricSpec("rollout_corr/k3_kl", "token-mean k3 estimate of KL(rollout || train)", "batch",
               low=0),
    MetricSpec("rollout_corr/log_ppl_diff", "mean over sequences of (train log-ppl - rollout "
               "log-ppl)", "batch"),
    MetricSpec("rollout_corr/max_abs_log_prob_diff", "max |old_log_prob - rollout_log_prob| over "
               "valid tokens", "batch", low=0),
    # ---- DAPO ----------------------------------------------------------------------------------
    MetricSpec("train/num_gen_batches", "generation batches needed to fill the train batch",
               "batch", low=1),
    MetricSpec("train/num_kept_groups", "prompt groups kept by the group filter", "batch", low=0),
    MetricSpec("train/overlong_penalty_mean", "mean over trajectories of the overlong penalty",
               "batch", high=0),
    # ---- timing --------------------------------------------------------------------------------
    MetricSpec("timing/step", "seconds per training step", "timing", low=0, golden=False),
    MetricSpec("timing/gen", "seconds in generation", "timing", low=0, golden=False),
    MetricSpec("timing/update_actor", "seconds in the actor update", "timing", low=0, golden=False),
    MetricSpec("timing/update_critic", "seconds in the critic update", "timing", low=0,
               golden=False),
]

#: families of names: one spec for every name of the pattern, ``{}`` standing for an identifier
#: (a reward function's name: rlaudit/data/rewards.py)
_FAMILIES: list[MetricSpec] = [
    MetricSpec("critic/score/{}/mean", "mean score of reward function {} over the rows it "
               "scored (TRL's rewards/<func>/mean; rollouts with several reward functions)",
               "batch"),
]


def _family(name: str) -> MetricSpec | None:
    for fam in _FAMILIES:
        head, tail = fam.name.split("{}")
        if (len(name) > len(head) + len(tail) and name.startswith(head) and name.endswith(tail)
                and name[len(head):len(name) - len(tail)].isidentifier()):
            return fam
    return None


class _Catalogue(dict):
    """name -> MetricSpec: the listed names, and any name of a family pattern (its family's
    spec). Iterating gives the listed names only."""

    def __missing__(self, name):
        fam = _family(name) if isinstance(name, str) else None
        if fam is None:
            raise KeyError(name)
        return fam

    def get(self, name, default=None):
        try:
            return self[name]
        except KeyError:
            return default

    def __contains__(self, name) -> bool:
        return dict.__contains__(self, name) or (isinstance(name, str)
                                                 and _family(name) is not None)


CATALOGUE: dict[str, MetricSpec] = _Catalogue({s.name: s for s in _SPECS})

#: the bookkeeping metric of tokens whose clip decision rounding may flip (rlaudit/update/actor.py)
CLIP_UNDECIDED = "actor/pg_clipfrac_undecided"
#: when a token's clip flag is rounding's to decide, by the float32 run-level tolerance a trainer
#: is compared under (rlaudit.targets.contract.declare.RUN_TOLERANCES): a ratio within rtol 1e-4
#: of a clip bound may sit on either side of it, and outside the clip band an advantage within
#: atol 1e-5 of 0 may have either sign (a GRPO group whose mean is not representable: -1.5e-8
#: in float64, 0 in float32), which decides whether the clipped term is the larger
CLIP_UNDECIDED_RTOL = 1e-4
CLIP_UNDECIDED_ATOL = 1e-5


def spec(name: str) -> MetricSpec:
    try:
        return CATALOGUE[name]
    except KeyError:
        raise KeyError(f"metric {name!r} is not in the catalogue (rlaudit/metrics.py)") from None


def counted(name: str) -> str:
    """``MetricSpec.counted`` of ``name`` ("" for a name outside the catalogue)."""
    s = CATALOGUE.get(name)
    return s.counted if s is not None else ""


def check_known(names: Iterable[str]) -> None:
    """Raise if any metric name is not catalogued (a typo in a backend is a bug, not a metric)."""
    unknown = sorted(n for n in set(names) if n not in CATALOGUE)
    if unknown:
        raise KeyError(f"metrics not in the catalogue (rlaudit/metrics.py): {unknown}")


def golden_names(names: Iterable[str]) -> list[str]:
    """The subset of ``names`` that goldens compare (timing and bookkeeping excluded)."""
    return sorted(n for n in names if CATALOGUE.get(n) is not None and CATALOGUE[n].golden)


def golden_bound(ref: float, rtol: float, atol: float) -> float:
    """How far a value may lie from ``ref`` under the golden comparison's rule: it passes when
    ``|value - ref| <= atol + rtol * |ref|`` (a NaN anywhere fails)."""
    return atol + rtol * abs(ref)
