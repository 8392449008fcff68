"""What each numeric config value may be: one table, read by the checks and by the docs.

Every ``int`` or ``float`` field (optional or not, and each item of a tuple of numbers) of the
:mod:`rlaudit.config` dataclasses has a row in :data:`BOUNDS`, keyed by its dataclass's name and
field name; :func:`check_bounds` walks a built config and checks each value against its row, and
raises ``TypeError`` (a bug, found by the first test that builds a config) for a numeric field
without one, so a new key cannot skip the check. Floats must always be finite: a NaN learning
rate or an infinite KL coefficient is never what a user means, and both replay to numbers that
look like a trainer bug.

    >>> describe(BOUNDS["OptimConfig"]["lr"])
    'a finite number >= 0'
"""

from __future__ import annotations

import dataclasses
import math
import typing
from dataclasses import dataclass

from rlaudit.errors import InputError


@dataclass(frozen=True)
class Bound:
    """The range of one numeric value: ``low``/``high`` (None = unbounded), each open or closed;
    ``why`` says what a value outside would break.

    ``limit``: for a size that drives work or memory (steps, epochs, parallel sizes, padding,
    rows), the largest value an audit takes, ``limit_why`` what the size counts. Checked when a
    scenario is loaded (rlaudit/scenarios/bounds.py: "above the limit of ..."), not by
    :func:`check_bounds`: each limit is far past any real audit scenario (rlaudit's own use at
    most 4 steps, 2 epochs, 4-way layouts) and near where a replay on a fixed rollout stops being
    an audit and becomes a training run, so a limit hit is a typo or a hostile file."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    why: str = ""
    limit: int | None = None
    limit_why: str = ""

    def holds(self, v: float) -> bool:
        if isinstance(v, float) and not math.isfinite(v):
            return False
        if self.low is not None and (v <= self.low if self.low_open else v < self.low):
            return False
        if self.high is not None and (v >= self.high if self.high_open else v > self.high):
            return False
        return True


def describe(b: Bound, *, integer: bool = False) -> str:
    """``b`` in words: 'a finite number in (0, 1]', 'an integer >= 1', ..."""
    what = "an integer" if integer else "a finite number"
    low, high = _num(b.low), _num(b.high)
    if b.low is not None and b.high is not None:
        return (f"{what} in {'(' if b.low_open else '['}{low}, {high}"
                f"{')' if b.high_open else ']'}")
    if b.low is not None:
        return f"{what} {'>' if b.low_open else '>='} {low}"
    if b.high is not None:
        return f"{what} {'<' if b.high_open else '<='} {high}"
    return what


def _num(x) -> str:
    return f"{x:g}" if isinstance(x, float) else str(x)


ANY = Bound()
NON_NEGATIVE = Bound(low=0)
POSITIVE = Bound(low=0, low_open=True)
AT_LEAST_1 = Bound(low=1)
UNIT = Bound(low=0, high=1)


def count(limit: int, what: str, *, low: int = 1) -> Bound:
    """A size that drives work: an integer from ``low`` up to the audit ``limit`` (see
    :class:`Bound`); ``what`` it counts."""
    return Bound(low=low, limit=limit, limit_why=what)


EPOCHS = count(1_000, "passes over the rollout per step")
TOKENS = 1_048_576  # a padded sequence's tokens, and rows of logits held at once

_OPTIM = {
    "lr": Bound(low=0, why="a negative rate climbs the loss"),
    "weight_decay": NON_NEGATIVE,
    "betas": Bound(low=0, high=1, high_open=True, why="Adam's moment decay rates"),
    "eps": Bound(low=0, low_open=True, why="Adam divides by sqrt(v) + eps"),
}

#: the rows of a scenario file's own numeric keys (not a config dataclass: check_bounds never
#: reads them; the scenario loader does)
SCENARIO = "Scenario"

#: config dataclass name -> field -> bound, both ends (see the module docstring and
#: :class:`Bound`; names, not the classes, so that rlaudit.config can call this module without a
#: circle), and :data:`SCENARIO`'s keys
BOUNDS: dict[str, dict[str, Bound]] = {
    SCENARIO: {"steps": count(10_000, "optimizer steps replayed on one fixed rollout")},
    "OptimConfig": _OPTIM,
    "FilterGroupsConfig": {"max_num_gen_batches": ANY},  # <= 0 means no limit
    "AlgorithmConfig": {
        "gamma": UNIT, "lam": UNIT,
        "grpo_std_eps": Bound(low=0, low_open=True, why="GRPO divides by std + eps"),
        "kl_coef": NON_NEGATIVE,
    },
    "RolloutCorrectionConfig": {
        "rollout_is_threshold": POSITIVE, "rollout_is_threshold_lower": POSITIVE,
        "rollout_kl_loss_coef": NON_NEGATIVE,
    },
    "DistillConfig": {"coef": NON_NEGATIVE},
    "ActorConfig": {
        "loss_scale_factor": POSITIVE,
        "clip_ratio": NON_NEGATIVE, "clip_ratio_low": NON_NEGATIVE,
        "clip_ratio_high": NON_NEGATIVE,
        "clip_ratio_c": Bound(low=1, low_open=True, why="the dual-clip bound"),
        "entropy_coeff": ANY, "kl_loss_coef": NON_NEGATIVE,
        "ppo_mini_batch_size": AT_LEAST_1, "ppo_micro_batch_size_per_gpu": AT_LEAST_1,
        "ppo_max_token_len_per_gpu": AT_LEAST_1, "ppo_epochs": EPOCHS,
        "context_parallel_size": count(1_024, "simulated ranks each sequence is split over"),
        "grad_clip": ANY,  # <= 0 disables clipping
        "logprob_chunk_size": count(TOKENS, "rows of logits held at once (memory ~ chunk x "
                                            "vocab x 5 bytes)"),
    },
    "CriticConfig": {
        "cliprange_value": NON_NEGATIVE, "ppo_micro_batch_size_per_gpu": AT_LEAST_1,
        "ppo_epochs": EPOCHS, "grad_clip": ANY,
    },
    "RolloutConfig": {
        "n": count(4_096, "responses per prompt"), "temperature": POSITIVE,
        "top_p": Bound(low=0, high=1, low_open=True), "top_k": Bound(low=-1, why="-1 or 0 = off"),
        "response_length": count(TOKENS, "tokens a padded response is allocated"),
        "prompt_length": count(TOKENS, "tokens a padded prompt is allocated"),
    },
    "OverlongBufferConfig": {"len": Bound(low=1, why="the penalty divides by it"),
                           "penalty_factor": NON_NEGATIVE},
    "RewardConfig": {},
    "DataConfig": {"train_batch_size": count(65_536, "prompts per step"),
                   "gen_batch_size": AT_LEAST_1},
    "TrainerConfig": {"seed": Bound(low=0, high=2 ** 63, high_open=True,
                                  why="torch.manual_seed's range"),
                    "total_steps": AT_LEAST_1,
                    "extra_padding_microbatches": count(
                        1_024, "padding micro-batches run on every rank, every optimizer step",
                        low=0)},
    "Config": {},
}


def numeric_kind(tp) -> str | None:
    """'int' or 'float' for a numeric field type (Optional and tuples of one number type
    included), else None."""
    args = [a for a in typing.get_args(tp) if a is not type(None) and a is not Ellipsis]
    if tp in (int, float):
        return tp.__name__
    if args and all(a in (int, float) for a in args):
        return "float" if float in args else "int"
    return None


def numeric_fields(cls, prefix: str = ""):
    """(dataclass, field name, dotted key, 'int'|'float') of every numeric field under ``cls``."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            yield from numeric_fields(tp, f"{prefix}{f.name}.")
        elif (kind := numeric_kind(tp)) is not None:
            yield cls, f.name, f"{prefix}{f.name}", kind


def documented(cfg_cls) -> list[tuple[str, str]]:
    """(dotted key, its range in words with why) of every numeric key under the config dataclass
    ``cfg_cls``: what the docs and ``rlaudit list`` can show next to each key's docstring."""
    out = []
    for cls, name, key, kind in numeric_fields(cfg_cls):
        row = BOUNDS[cls.__name__][name]
        out.append((key, describe(row, integer=kind == "int") + (f" ({row.why})" if row.why
                                                                else "")))
    return out


def check_bounds(cfg, *, source: str | None = None, prefix: str = "") -> None:
    """Every numeric value of ``cfg`` (an rlaudit.config.Config) against :data:`BOUNDS`:
    InputError naming ``source`` and the dotted key, with what was expected."""
    for cls, name, key, kind in numeric_fields(type(cfg)):
        row = BOUNDS.get(cls.__name__, {}).get(name)
        if row is None:
            raise TypeError(f"config field {key} has no row in rlaudit.config_bounds.BOUNDS")
        value = _get(cfg, key)
        items = list(enumerate(value)) if isinstance(value, tuple) else [(None, value)]
        for i, v in items:
            if v is None or row.holds(v):
                continue
            where = f"{prefix}{key}" if i is None else f"{prefix}{key}[{i}]"
            why = f" ({row.why})" if row.why else ""
            raise InputError(f"expected {describe(row, integer=kind == 'int')}{why}, got {v!r}",
                             source=source, key=where)


def _get(cfg, dotted: str):
    for part in dotted.split("."):
        cfg = getattr(cfg, part)
    return cfg
