"""What a target declares about itself: the precision it computes in, tolerance overrides, how
it reduces metrics over micro-batches, and its deliberate semantic differences from the reference.

A correct trainer computing in float32, or one that made a documented upstream choice the
reference does not share (verl scores a row by the unmasked sum of its token rewards), must not
go red: a red that does not mean "broken" makes the audit useless. So an adapter declares:

- ``precision`` (stage functions) and ``train_precision`` (train_step's model math): the
  tolerances of every comparison are derived from them (:data:`STAGE_TOLERANCES`,
  :data:`RUN_TOLERANCES`); ``tolerances`` overrides any of them explicitly;
- ``metric_reduction``: ``contribution`` (rlaudit's: each micro-batch returns its share of the
  global value) or ``microbatch-mean`` (each micro-batch reports its own local mean and the logged
  value is their mean: verl's ``AggregationType.MEAN``, TRL);
- ``differences``: :class:`Difference` records with a reason and an upstream link. One with a
  ``convention`` the reference can compute makes the covered checks run under that convention;
  one without turns what would be a failure of a covered check into the third state
  ``differs`` (declared). Anything undeclared that differs still fails;
- ``filters_groups``: ``train_step`` applies DAPO's group filter itself, so it is handed the
  unfiltered rows of DAPO scenarios (rlaudit/targets/inputs/dynamic_sampling.py).

Every declaration is validated when the adapter is loaded (:func:`read_declarations`): a wrong one is an
input error (exit 2) naming the attribute.
"""

from __future__ import annotations

import fnmatch
import inspect
import math
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch

from rlaudit.algo.kl import K3_CLAMPS, KL_LOSS_WEIGHTS
from rlaudit.errors import InputError
from rlaudit.metrics import CATALOGUE
from rlaudit.targets.contract.adapter import STAGES, adapter_name
from rlaudit.verdict.tolerance import Tolerance

#: stage-level tolerance per arithmetic precision. atol is multiplied by the magnitude of the
#: compared quantity (:func:`scaled`): rounding errors are relative to the operands' size, and a
#: whitened zero-variance batch has an expected value of exactly 0 at magnitude 1.
#: float64: the same formula evaluated in another order (~1e-15) with five orders of room;
#: float32: eps 1.2e-7, ~100 rounding steps (log-softmax, exp of ratios, sums over a batch);
#: bfloat16: eps 7.8e-3, a few rounding steps.
STAGE_TOLERANCES: dict[str, Tolerance] = {
    "float64": Tolerance(rtol=1e-7, atol=1e-9),
    "float32": Tolerance(rtol=2e-5, atol=2e-6),
    "bfloat16": Tolerance(rtol=2e-2, atol=2e-2),
}
#: run-level floor per train precision (a target's run compared with rlaudit's reference backend
#: over whole training steps: forward, backward, optimizer, several steps). ``float64`` keeps the
#: scenario's own tolerances; ``hf-float64`` is a stock Hugging Face model loaded in float64,
#: which keeps float32 islands (RoPE, RMSNorm's variance, the eager softmax): rows move by ~1e-7
#: relative with the batch composition, the bugs the invariants exist for move results by 1e-3.
RUN_TOLERANCES: dict[str, Tolerance | None] = {
    "float64": None,
    "hf-float64": Tolerance(rtol=1e-5, atol=1e-6),
    "float32": Tolerance(rtol=1e-4, atol=1e-5),
    "bfloat16": Tolerance(rtol=5e-2, atol=5e-2),
}
#: relative size of the weight perturbation that measures a target's noise floor at run level:
#: the unit roundoff of the precision its model math rounds to (float32 islands or float32
#: throughout: 2^-24; bfloat16: 2^-8). The reference replays every variant once with its
#: weights multiplied by 1 + noise * N(0, 1); comparisons allow NOISE_FACTOR (compare.py) times
#: the spread this causes, so a scenario whose result amplifies rounding (a large learning rate,
#: AdamW on near-zero gradients, several steps) gets the room it needs and no more.
NOISE_SCALE: dict[str, float] = {"hf-float64": 2.0 ** -24, "float32": 2.0 ** -24,
                                 "bfloat16": 2.0 ** -8}
DEFAULT_PRECISION = "float64"
DEFAULT_TRAIN_PRECISION = "hf-float64"
METRIC_REDUCTIONS = ("contribution", "microbatch-mean")

@dataclass(frozen=True)
class Convention:
    """A semantic choice rlaudit's reference can compute either way: ``config`` is the dotted
    config key the reference reads it from (run level; None: stage checks only), ``values`` the
    allowed values (a tuple, or a type: ``float``); stage checks pass it to the reference
    function as ``kwarg``."""

    config: str | None
    values: tuple | type
    doc: str

    def check(self, value, source: str, key: str):
        if isinstance(self.values, tuple):
            return _names(value, self.values, key, source)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise InputError(f"expected a number > 0, got {value!r}", source=source, key=key)
        return float(value)


#: conventions rlaudit's reference can compute (the first value of each is rlaudit's own)
CONVENTIONS: dict[str, Convention] = {
    "outcome_score": Convention(
        "algorithm.outcome_score", ("masked-sum", "unmasked-sum"),
        "outcome estimators score a row by the sum of its valid token rewards, or of every "
        "position's (verl)"),
    "grpo_std_eps": Convention(
        "algorithm.grpo_std_eps", float,
        "GRPO divides by (group std + eps): 1e-6 (verl, rlaudit), 1e-4 (TRL)"),
    "seq_count": Convention(
        "actor.loss_seq_count", ("valid-rows", "all-rows"),
        "N_seq of the seq-mean aggregations counts rows with a valid token, or every row "
        "(SkyRL, slime, TRL)"),
    "token_denominator": Convention(
        "actor.loss_token_denominator", ("minibatch", "batch-mean"),
        "N_tok of token-mean is the mini-batch's valid tokens, or the training batch's divided "
        "by the number of mini-batches (TRL's dapo); run level only"),
    "k3_clamp": Convention(
        "algorithm.k3_clamp", K3_CLAMPS,
        "k3 / low_var_kl clamps its per-token value at 10 (verl, rlaudit) or not at all (TRL's "
        "beta term, textbook k3); both keep the +-20 log-ratio clamp against overflow"),
    "kl_loss_weight": Convention(
        "actor.kl_loss_weight", KL_LOSS_WEIGHTS,
        "the actor's KL loss term is the estimator per token (verl, rlaudit), or the estimator "
        "times the differentiable importance ratio pi / pi_old (TRL's default "
        "use_bias_correction_kl: the unbiased reverse-KL gradient)"),
    "gspo_gradient": Convention(
        "actor.gspo_gradient", ("per-token", "sequence"),
        "GSPO's ratio is differentiated per token (GSPO-token: verl, rlaudit) or through the "
        "sequence mean (GSPO's sequence-level objective: slime, TRL); same values"),
    "token_budget": Convention(
        None, ("prompt+response", "response"),
        "a micro-batch token budget counts each row's prompt and response tokens (verl's "
        "ppo_max_token_len_per_gpu, SkyRL, rlaudit) or its response tokens only; stage level "
        "(make_microbatches:within-token-budget)"),
}


@dataclass(frozen=True)
class Difference:
    """A deliberate semantic difference of the target from rlaudit's reference.

    Attributes:
        name: a short id (``"outcome-score-unmasked-sum"``), shown in reports.
        reason: one line: what the target does, and why it is deliberate.
        link: the upstream reference (code at a tag, a PR, an issue, the docs).
        checks: the checks it covers: stage check names (``"compute_advantages:parity"``) or
            run-level invariant names (``"backend-parity"``); ``fnmatch`` patterns allowed
            (``"compute_advantages:*"``).
        cases: narrows it to problems whose message contains one of these substrings (an input
            case such as ``"without a valid token"``, a variant name, a metric name); empty:
            every problem of the covered checks.
        convention: ``{key: value}`` from :data:`CONVENTIONS`: the covered checks compute the
            reference under it, so they pass or fail as usual. Without one, a covered problem is
            reported ``differs`` instead of ``fail``.
    """

    name: str
    reason: str
    link: str
    checks: tuple[str, ...]
    cases: tuple[str, ...] = ()
    convention: Mapping[str, str] | None = None

    def covers_check(self, check: str) -> bool:
        return any(fnmatch.fnmatchcase(check, pattern) for pattern in self.checks)

    def covers(self, check: str, message: str) -> bool:
        """Whether a problem ``message`` of ``check`` is this difference (conventions cover
        nothing: their checks run under them instead)."""
        if self.convention or not self.covers_check(check):
            return False
        return not self.cases or any(c in message for c in self.cases)

    def describe(self) -> str:
        return f"{self.name}: {self.reason} ({self.link})"


@dataclass
class Declarations:
    """An adapter's validated declarations (:func:`read_declarations`)."""

    precision: str = DEFAULT_PRECISION
    train_precision: str = DEFAULT_TRAIN_PRECISION
    stage_precision: dict[str, str] = field(default_factory=dict)
    tolerances: dict[str, Tolerance] = field(default_factory=dict)
    metric_reduction: str = "contribution"
    """The reduction of every metric not in :attr:`metric_reduction_except`."""
    metric_reduction_except: tuple[str, ...] = ()
    """Metric names reduced the other way (``metric_reduction = {"actor/loss": "contribution",
    "*": "microbatch-mean"}`` declares "microbatch-mean" except actor/loss)."""
    differences: tuple[Difference, ...] = ()
    #: train_step applies DAPO's group filter itself (gets the unfiltered rows)
    filters_groups: bool = False

    def metric_mode(self, name: str) -> str:
        """"contribution" or "microbatch-mean": how the target reduces metric ``name``."""
        if name in self.metric_reduction_except:
            return ({"contribution": "microbatch-mean", "microbatch-mean": "contribution"}
                    [self.metric_reduction])
        return self.metric_reduction

    def config_overrides(self) -> dict[str, Any]:
        """Dotted config keys that make the reference compute as the target declares: every
        convention of every difference, and the metric reduction (run level)."""
        out: dict[str, Any] = {}
        for d in self.differences:
            for k, v in (d.convention or {}).items():
                if CONVENTIONS[k].config is not None:
                    out[CONVENTIONS[k].config] = v
        if self.metric_reduction != "contribution" or self.metric_reduction_except:
            out["trainer.metric_reduction"] = self.metric_reduction
            out["trainer.metric_reduction_except"] = list(self.metric_reduction_except)
        return out

    def stage_tolerance(self, check: str) -> Tolerance:
        """The tolerance of stage check ``check`` (``"policy_loss:parity"``): an override for the
        check, its stage or ``"*"``; else derived from the stage's precision."""
        stage = check.split(":")[0]
        for key in (check, stage, "*"):
            if key in self.tolerances:
                return self.tolerances[key]
        return STAGE_TOLERANCES[self.stage_precision.get(stage, self.precision)]

    def run_floor(self) -> Tolerance | None:
        """The run-level floor of every comparison (None: the scenario's own tolerances)."""
        return RUN_TOLERANCES[self.train_precision]

    def noise(self) -> float:
        """Relative weight noise measuring the run-level noise floor (0: none, exact float64)."""
        return NOISE_SCALE.get(self.train_precision, 0.0)

    def run_overrides(self) -> dict[str, Tolerance]:
        """Run-level overrides by metric/tensor/invariant name (stage-check keys excluded)."""
        return {k: v for k, v in self.tolerances.items() if ":" not in k}

    def conventions(self, check: str) -> dict[str, str]:
        """The conventions the reference must use for ``check``."""
        out: dict[str, str] = {}
        for d in self.differences:
            if d.convention and d.covers_check(check):
                out.update(d.convention)
        return out

    def declared(self, check: str, message: str) -> Difference | None:
        """The declared difference (without a convention) that a problem of ``check`` is."""
        return next((d for d in self.differences if d.covers(check, message)), None)


def _names(value: Any, allowed, attr: str, source: str) -> str:
    if value not in allowed:
        raise InputError(f"expected one of {list(allowed)}, got {value!r}", source=source,
                         key=attr)
    return value


def _tolerance(value: Any, source: str, key: str) -> Tolerance:
    if isinstance(value, Tolerance):
        return value
    if not isinstance(value, Mapping) or not value or set(value) - {"rtol", "atol"}:
        raise InputError(f"expected a Tolerance or a mapping with rtol and/or atol, got "
                         f"{value!r}", source=source, key=key)
    vals = {}
    for k in ("rtol", "atol"):
        v = value.get(k, 0.0)
        if (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v)
                or v < 0):
            raise InputError(f"expected a finite number >= 0, got {v!r}", source=source,
                             key=f"{key}.{k}")
        vals[k] = float(v)
    return Tolerance(**vals)


def _difference(d: Any, source: str, key: str) -> Difference:
    if not isinstance(d, Difference):
        raise InputError(f"expected rlaudit.targets.Difference, got {type(d).__name__}",
                         source=source, key=key)
    for attr in ("name", "reason", "link"):
        v = getattr(d, attr)
        if not isinstance(v, str) or not v.strip():
            raise InputError(f"expected a non-empty string, got {v!r}", source=source,
                             key=f"{key}.{attr}")
    for attr in ("checks", "cases"):
        v = getattr(d, attr)
        if isinstance(v, str) or not isinstance(v, (tuple, list)) or not all(
                isinstance(x, str) and x for x in v):
            raise InputError(f"expected a tuple of non-empty strings, got {v!r}", source=source,
                             key=f"{key}.{attr}")
    if not d.checks:
        raise InputError("a difference must name the checks it covers", source=source,
                         key=f"{key}.checks")
    if d.convention is not None:
        if not isinstance(d.convention, Mapping) or not d.convention:
            raise InputError(f"expected a mapping from {list(CONVENTIONS)}, got "
                             f"{d.convention!r}", source=source, key=f"{key}.convention")
        for k, v in d.convention.items():
            if k not in CONVENTIONS:
                raise InputError(f"unknown convention {k!r}; the reference can compute: "
                                 f"{', '.join(CONVENTIONS)}", source=source,
                                 key=f"{key}.convention")
            CONVENTIONS[k].check(v, source, f"{key}.convention.{k}")
    return d


def read_declarations(adapter: object) -> Declarations:
    """The adapter's declarations, validated (InputError naming the attribute otherwise)."""
    source = adapter_name(adapter)
    precisions = tuple(STAGE_TOLERANCES)
    out = Declarations()
    out.precision = _names(getattr(adapter, "precision", None) or DEFAULT_PRECISION, precisions,
                           "precision", source)
    # a trainer that declares float32 or bfloat16 and says nothing of train_step computes its
    # training in it too; otherwise a stock HF model in float64 (float32 islands)
    implied = out.precision if out.precision in ("float32", "bfloat16") else None
    out.train_precision = _names(getattr(adapter, "train_precision", None) or implied
                                 or DEFAULT_TRAIN_PRECISION, tuple(RUN_TOLERANCES),
                                 "train_precision", source)
    stage_precision = getattr(adapter, "stage_precision", None) or {}
    if not isinstance(stage_precision, Mapping):
        raise InputError(f"expected a mapping stage -> precision, got {stage_precision!r}",
                         source=source, key="stage_precision")
    for stage, p in stage_precision.items():
        _names(stage, tuple(STAGES), "stage_precision", source)
        out.stage_precision[stage] = _names(p, precisions, f"stage_precision.{stage}", source)
    tols = getattr(adapter, "tolerances", None) or {}
    if not isinstance(tols, Mapping):
        raise InputError(f"expected a mapping name -> {{rtol, atol}}, got {tols!r}",
                         source=source, key="tolerances")
    out.tolerances = {str(k): _tolerance(v, source, f"tolerances.{k}") for k, v in tols.items()}
    reduction = getattr(adapter, "metric_reduction", None) or "contribution"
    if isinstance(reduction, Mapping):
        modes = {str(k): _names(v, METRIC_REDUCTIONS, f"metric_reduction[{k!r}]", source)
                 for k, v in reduction.items()}
        unknown = sorted(k for k in modes if k != "*" and k not in CATALOGUE)
        if unknown:
            raise InputError(f"unknown metric name(s) {unknown} (rlaudit/metrics.py)",
                             source=source, key="metric_reduction")
        out.metric_reduction = modes.get("*", "contribution")
        out.metric_reduction_except = tuple(sorted(
            k for k, v in modes.items() if k != "*" and v != out.metric_reduction))
    else:
        out.metric_reduction = _names(reduction, METRIC_REDUCTIONS, "metric_reduction", source)
    filters = getattr(adapter, "filters_groups", False)
    if not isinstance(filters, bool):
        raise InputError(f"expected True or False, got {filters!r}", source=source,
                         key="filters_groups")
    out.filters_groups = filters
    diffs = getattr(adapter, "differences", None) or ()
    if isinstance(diffs, Difference) or not isinstance(diffs, (tuple, list)):
        raise InputError("expected a tuple of Difference", source=source, key="differences")
    out.differences = tuple(_difference(d, source, f"differences[{i}]")
                            for i, d in enumerate(diffs))
    names = [d.name for d in out.differences]
    if len(set(names)) != len(names):
        raise InputError(f"difference names must be unique, got {names}", source=source,
                         key="differences")
    return out


def scaled(tol: Tolerance, want: torch.Tensor, mask: torch.Tensor | None = None) -> Tolerance:
    """``tol`` with atol multiplied by the magnitude of the expected values: max(1, max |want|
    over ``mask``), non-finite entries ignored."""
    w = want.detach().double().abs()
    if mask is not None and mask.shape == w.shape:
        w = torch.where(mask.bool(), w, 0.0)
    w = torch.where(torch.isfinite(w), w, 0.0)
    mag = max(1.0, float(w.max())) if w.numel() else 1.0
    return Tolerance(rtol=tol.rtol, atol=tol.atol * mag)


def source_line(fn, needle: str = "") -> str:
    """``#L<n>``: the line of ``fn``'s installed source holding ``needle`` (its first line
    without one; "" when the source cannot be read), for a :class:`Difference`'s link to the
    line at a peer's release tag."""
    try:
        lines, first = inspect.getsourcelines(fn)
    except (OSError, TypeError):
        return ""
    offset = next((i for i, line in enumerate(lines) if needle in line), 0) if needle else 0
    return f"#L{first + offset}"
