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
    """The range of one numeric config value: ``low``/``high`` (None = unbounded), each open or
    closed; ``why`` says what a value outside would break."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    why: str = ""

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

_OPTIM = {
    "lr": Bound(low=0, why="a negative rate climbs the loss"),
    "weight_decay": NON_NEGATIVE,
    "betas": Bound(low=0, high=1, high_open=True, why="Adam's moment decay rates"),
    "eps": Bound(low=0, low_open=True, why="Adam divides by sqrt(v) + eps"),
}

#: config dataclass name -> field -> bound (see the module docstring; names, not the classes,
#: so that rlaudit.config can call this module without a circle)
BOUNDS: dict[str, dict[str, Bound]] = {
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
        "ppo_max_token_len_per_gpu": AT_LEAST_1, "ppo_epochs": AT_LEAST_1,
        "context_parallel_size": AT_LEAST_1,
        "grad_clip": ANY,  # <= 0 disables clipping
        "logprob_chunk_size": AT_LEAST_1,
    },
    "CriticConfig": {
        "cliprange_value": NON_NEGATIVE, "ppo_micro_batch_size_per_gpu": AT_LEAST_1,
        "ppo_epochs": AT_LEAST_1, "grad_clip": ANY,
    },
    "RolloutConfig": {
        "n": AT_LEAST_1, "temperature": POSITIVE,
        "top_p": Bound(low=0, high=1, low_open=True), "top_k": Bound(low=-1, why="-1 or 0 = off"),
        "response_length": AT_LEAST_1, "prompt_length": AT_LEAST_1,
    },
    "OverlongBufferConfig": {"len": Bound(low=1, why="the penalty divides by it"),
                           "penalty_factor": NON_NEGATIVE},
    "RewardConfig": {},
    "DataConfig": {"train_batch_size": AT_LEAST_1, "gen_batch_size": AT_LEAST_1},
    "TrainerConfig": {"seed": Bound(low=0, high=2 ** 63, high_open=True,
                                  why="torch.manual_seed's range"),
                    "total_steps": AT_LEAST_1, "extra_padding_microbatches": NON_NEGATIVE},
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
