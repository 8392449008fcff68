"""The adapter API: how someone else's trainer exposes its stages to rlaudit's checks.

An adapter is any object (usually a small class) with a ``name`` and any subset of the stage methods
(see "Stages" below). ``rlaudit run --target module:Attr`` imports it, instantiates it when ``Attr``
is a class, and runs every check whose stage is provided; a check whose stage is missing is reported
``n/a``, never ``pass``. Subclassing :class:`TargetAdapter` is optional (it only supplies the
defaults of the optional attributes). docs/targets.md is the user guide; this module is the
contract.

Conventions (docs/internals.md): per-token tensors are padded, response-aligned ``[B, R]``;
``response_mask`` ``[B, R]`` bool, True = the token counts; ``uid`` ``[B]`` int64 group id (rows
of a group need not be contiguous, groups may be singletons); float64 inputs. A stage must not
modify its inputs in place, and its outputs must not share storage with its inputs or with each
other. Stages receive keyword arguments only.

Stages (each optional): the methods of :class:`rlaudit.targets.contract.stages.Stages`, whose
signatures are the contract (``filter_groups``, ``compute_advantages``, ``apply_kl_in_reward``,
``kl_penalty``, ``agg_loss``, ``policy_loss``, ``value_loss``, ``make_microbatches``,
``distill_loss``, ``train_step``).

Optional attributes: ``name`` (the column in reports; default the class name),
``advantage_estimators``, ``kl_estimators``, ``loss_agg_modes``, ``loss_modes``,
``distill_losses`` (names the stage implements; default: every name the reference has),
``metric_names`` (catalogue names train_step logs, see run/target_backend.py) and
``supports(config) -> (bool, why)`` (whether train_step can run a config; an unsupported variant
makes the invariants that need it n/a) and ``filters_groups`` (True: ``train_step`` applies DAPO's
group filter itself, so scenarios with ``algorithm.filter_groups.enable`` hand it the unfiltered
rows; see rlaudit/targets/inputs/dynamic_sampling.py) and ``engines`` (a tuple of adapters, one
per training engine of the trainer, each its own report column, compared with the reference and
with the first engine; see rlaudit/targets/run/engines.py).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch

from rlaudit.errors import InputError

#: Every stage method, in the order checks run, with the check families it unlocks.
STAGES: dict[str, str] = {
    "filter_groups": "DAPO dynamic sampling: exactly the groups whose metric has spread (and "
                     "singletons) are kept; every field stays aligned with its row; no mutation",
    "compute_advantages": "advantages per estimator vs the reference; grouped by uid (row "
                          "permutation); values under mask 0 ignored; no mutation/aliasing",
    "apply_kl_in_reward": "stored KL unaltered (slime #2114); rewards = scores - kl_coef * kl; "
                          "no mutation/aliasing",
    "kl_penalty": "every KL estimator's values and gradients vs the reference",
    "agg_loss": "every loss_agg_mode vs the reference; micro-batch contributions with global "
                "denominators sum to the whole-batch value",
    "policy_loss": "loss, gradient and metrics vs the reference for every mode and clip "
                   "setting; global-normalisation split; row permutation; masked values; "
                   "metrics are copies",
    "value_loss": "the critic's clipped value loss, gradient and clip fraction vs the reference "
                  "for every loss_agg_mode; micro-batch contributions with global denominators "
                  "sum to the whole-batch value",
    "make_microbatches": "every valid token exactly once; equal micro-batch count per rank; every "
                         "micro-batch (padding ones included) carries every field (SkyRL #1811)",
    "distill_loss": "values vs the reference; nested (jagged) input matches padded input "
                    "(verl #5997)",
    "train_step": "metrics are copies; input batch unchanged; and, with a scenario, every "
                  "run-level invariant against the reference backend",
}

#: Exceptions a stage may raise to say "this name/setting is not implemented here": the case is
#: reported as skipped (and the check n/a if nothing else ran), never as passed or failed. Its
#: subclass rlaudit.verdict.unsupported.UnsupportedFeature ("this release lacks what the check
#: needs", feature and release named) makes the check ``unsupported`` if nothing else ran.
NOT_SUPPORTED = (NotImplementedError,)


@dataclass
class TrainStepOutput:
    """What ``train_step`` returns. Only ``metrics`` is required; every other field unlocks more
    checks (see docs/targets.md, "What train_step returns").

    Attributes:
        metrics: one dict per training step, catalogue names (rlaudit/metrics.py) -> float or
            0-dim tensor, reduced as the catalogue says (loss terms: global over the mini-batch,
            averaged over optimizer steps).
        log_probs: ``[B, R]`` log-probs of the response tokens under the *initial* policy
            (before any update), at ``config.rollout.temperature``; 0 or anything where
            ``response_mask`` is False (never compared there).
        entropy: ``[B, R]`` per-token entropy of the initial policy (same temperature).
        tokens: per-token ``[B, R]`` fields as the trainer held them at the end of step 0, under
            rlaudit names: ``old_log_probs``, ``ref_log_probs``, ``values``, ``kl`` (the stored
            KL that ``rollout/kl`` logs), ``token_level_scores``, ``token_level_rewards``,
            ``advantages``, ``returns``, ``rollout_is_weights``.
        params: one dict per step: every actor parameter after that step, unsharded, by its
            Hugging Face name (as in the snapshot's safetensors).
        microbatches: per step, per data-parallel rank, per optimizer step, the micro-batches the
            rank ran (padding ones included): each a RolloutBatch, a dict of rlaudit-named
            tensors, or the dict :func:`rlaudit.update.plan.describe_micro` returns.
    """

    metrics: list[Mapping[str, Any]]
    log_probs: torch.Tensor | None = None
    entropy: torch.Tensor | None = None
    tokens: Mapping[str, torch.Tensor] = field(default_factory=dict)
    params: list[Mapping[str, torch.Tensor]] = field(default_factory=list)
    microbatches: list[list[list[list[Any]]]] = field(default_factory=list)


class TargetAdapter:
    """Optional base class: defaults for the optional attributes. Define only the stage methods
    your trainer has; see the module docstring for their signatures."""

    name: str = ""
    advantage_estimators: tuple[str, ...] | None = None
    kl_estimators: tuple[str, ...] | None = None
    #: a tuple (every loss mode) or ``{loss_mode or "*": tuple}`` (capabilities per loss mode)
    loss_agg_modes: tuple[str, ...] | Mapping[str, tuple[str, ...]] | None = None
    loss_modes: tuple[str, ...] | None = None
    distill_losses: tuple[str, ...] | None = None
    metric_names: tuple[str, ...] | None = None
    # ---- declarations (contract/declare.py; docs/targets.md "Declaring your trainer")
    #: arithmetic precision of the stage functions: "float64" | "float32" | "bfloat16"
    precision: str = "float64"
    #: train_step's model math: "hf-float64" (stock HF model in float64, float32 islands),
    #: "float64" (exact, as rlaudit's backends), "float32", "bfloat16"; None: ``precision``
    #: when that is float32 or bfloat16, else "hf-float64"
    train_precision: str | None = None
    #: per-stage precision overrides: {stage: precision}
    stage_precision: Mapping[str, str] = {}
    #: explicit tolerance overrides: {check | stage | invariant | metric name | "*": {rtol, atol}}
    tolerances: Mapping[str, Any] = {}
    #: "contribution" | "microbatch-mean" (how metrics are reduced over micro-batches)
    metric_reduction: str = "contribution"
    #: deliberate semantic differences from the reference (rlaudit.targets.Difference)
    differences: tuple = ()
    #: train_step applies DAPO's group filter itself: hand it the unfiltered rows
    filters_groups: bool = False

    def supports(self, config) -> tuple[bool, str]:
        """Whether ``train_step`` can run ``config``; (False, why) makes its variants n/a."""
        return True, ""


def adapter_name(adapter: object) -> str:
    """``adapter.name`` if set, else its class name."""
    name = getattr(adapter, "name", "") or type(adapter).__name__
    if not isinstance(name, str):
        raise InputError(f"expected a string, got {name!r}", source=type(adapter).__name__,
                         key="name")
    return name


def has_stage(adapter: object, stage: str) -> bool:
    """True when the adapter provides ``stage`` (a callable attribute of that name)."""
    if stage not in STAGES:
        raise KeyError(stage)
    return callable(getattr(adapter, stage, None))


def provided_stages(adapter: object) -> list[str]:
    return [s for s in STAGES if has_stage(adapter, s)]


def accepts(fn, param: str) -> bool:
    """Whether callable ``fn`` takes keyword ``param`` (explicitly or through ``**kwargs``)."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return True
    return param in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


def supported_names(adapter: object, attr: str, reference, *, key: str | None = None
                    ) -> list[str]:
    """The names an adapter declares for a stage (``attr``, e.g. ``"loss_modes"``), or every
    name of ``reference`` (a registry: its canonical names; aliases are accepted when declared).
    Unknown declared names raise InputError naming the attribute.

    ``attr`` may also map keys to names (``loss_agg_modes = {"gspo": ("seq-mean-token-mean",)}``:
    capabilities per loss mode): ``key`` selects its entry, else the ``"*"`` entry, else every
    name of ``reference``; ``key=None`` (a stage without a loss mode, e.g. agg_loss) reads
    ``"*"`` the same way."""
    declared = getattr(adapter, attr, None)
    if isinstance(declared, Mapping):
        for k, names in declared.items():
            _declared_names(adapter, f"{attr}[{k!r}]", names, reference)
        declared = declared.get(key, declared.get("*")) if key is not None else declared.get("*")
    if declared is None:
        return list(reference)
    return _declared_names(adapter, attr, declared, reference)


def _declared_names(adapter: object, attr: str, declared, reference) -> list[str]:
    if isinstance(declared, str) or not all(isinstance(n, str) for n in declared):
        raise InputError(f"expected a tuple of names, got {declared!r}",
                         source=adapter_name(adapter), key=attr)
    unknown = sorted(n for n in declared if n not in reference)
    if unknown:
        raise InputError(f"unknown name(s) {unknown}; the reference has: "
                         f"{', '.join(list(reference))}", source=adapter_name(adapter), key=attr)
    return list(declared)


def supports(adapter: object, config) -> tuple[bool, str]:
    """``adapter.supports(config)`` normalised to ``(bool, why)`` (True when not defined)."""
    fn = getattr(adapter, "supports", None)
    if fn is None:
        return True, ""
    out = fn(config)
    if isinstance(out, tuple):
        ok, why = out
        return bool(ok), str(why)
    return bool(out), "" if out else "the adapter does not support this configuration"


def metric_floats(metrics: Mapping[str, Any], source: str) -> dict[str, float]:
    """``{name: float}`` from floats or one-element tensors; anything else is an InputError."""
    if not isinstance(metrics, Mapping):
        raise InputError(f"expected a dict of metrics per step, got {type(metrics).__name__}",
                         source=source, key="metrics")
    out = {}
    for name, value in metrics.items():
        try:
            out[name] = float(value.detach()) if isinstance(value, torch.Tensor) else float(value)
        except (TypeError, ValueError, RuntimeError):
            raise InputError(f"metric {name!r}: expected a number or a one-element tensor, got "
                             f"{type(value).__name__}", source=source, key="metrics") from None
    return out
