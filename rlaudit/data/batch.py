"""The rollout batch: B trajectories (prompt + response), padded, with a field kind per tensor.

Layout (the one every module of rlaudit assumes):

- ``B`` rows (trajectories). Rows of one prompt share a ``uid`` (the GRPO group id).
- Prompt tensors are ``[B, P]``, **left-aligned** and right-padded: row i's prompt is
  ``prompt_ids[i, :prompt_lengths[i]]``.
- Per-token tensors are **response-aligned** ``[B, R, ...]``: entry ``[i, t]`` belongs to the t-th
  response token of row i; row i's response is ``response_ids[i, :response_lengths[i]]``.
  ``response_mask[i, t]`` (bool) says whether that token counts in losses and metrics; it is
  False at and after ``response_lengths[i]`` and may also be False inside a response (e.g. tool
  output in multi-turn rollouts).
- The model sees, per row, ``prompt ++ response`` right-padded (no left padding, so position ids
  start at 0 on every backend); the log-prob of response token t comes from the logits at
  position ``prompt_lengths[i] - 1 + t``.

A batch is treated as immutable: every method returns a new batch whose tensors may be shared
with the old one (never written to). Stages that add fields use :meth:`RolloutBatch.with_fields`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Iterable, Mapping

import torch

from rlaudit.data.rewards import check_combined_scores
from rlaudit.errors import InputError


class Kind(str, enum.Enum):
    """How a field is laid out, which decides how batching and padding treat it."""

    SEQ = "seq"        # [B, ...]        one value (or vector) per trajectory
    PROMPT = "prompt"  # [B, P, ...]     prompt-aligned, right-padded
    TOKEN = "token"    # [B, R, ...]     response-aligned, right-padded, masked by response_mask


@dataclass(frozen=True)
class FieldSpec:
    kind: Kind
    dtype: str          # "int", "float" or "bool": the dtype family the field must have
    doc: str


#: Fields rlaudit knows by name. Other fields may be added with an explicit kind.
KNOWN_FIELDS: dict[str, FieldSpec] = {
    "prompt_ids": FieldSpec(Kind.PROMPT, "int", "prompt token ids, left-aligned, pad after"),
    "prompt_lengths": FieldSpec(Kind.SEQ, "int", "number of prompt tokens per row (>= 1)"),
    "response_ids": FieldSpec(Kind.TOKEN, "int", "response token ids, pad after"),
    "response_lengths": FieldSpec(Kind.SEQ, "int", "number of response tokens per row (>= 0)"),
    "response_mask": FieldSpec(Kind.TOKEN, "bool", "token counts in losses/metrics"),
    "uid": FieldSpec(Kind.SEQ, "int", "group id: rows sampled from the same prompt share it"),
    "scores": FieldSpec(Kind.SEQ, "float", "rule/reward-model score per trajectory"),
    "rollout_log_probs": FieldSpec(Kind.TOKEN, "float", "log-probs from the sampling engine"),
    "old_log_probs": FieldSpec(Kind.TOKEN, "float", "log-probs of the policy before the update"),
    "ref_log_probs": FieldSpec(Kind.TOKEN, "float", "log-probs of the reference policy"),
    "entropy": FieldSpec(Kind.TOKEN, "float", "per-token entropy of the policy before update"),
    "values": FieldSpec(Kind.TOKEN, "float", "critic values V(s_t) before the update"),
    "token_level_scores": FieldSpec(Kind.TOKEN, "float", "scores placed on the last token"),
    "token_level_rewards": FieldSpec(Kind.TOKEN, "float", "scores minus any KL-in-reward"),
    "advantages": FieldSpec(Kind.TOKEN, "float", "advantage estimates"),
    "returns": FieldSpec(Kind.TOKEN, "float", "return targets for the critic"),
    "kl": FieldSpec(Kind.TOKEN, "float", "stored per-token KL(old || ref) used in the reward"),
    "rollout_is_weights": FieldSpec(Kind.TOKEN, "float", "rollout importance weights"),
    "teacher_topk_ids": FieldSpec(Kind.TOKEN, "int", "[B, R, K] teacher's top-k token ids"),
    "teacher_topk_log_probs": FieldSpec(Kind.TOKEN, "float", "[B, R, K] teacher's top-k log-probs"),
    "teacher_log_probs": FieldSpec(Kind.TOKEN, "float", "teacher log-prob of the sampled token"),
    "reward_scores": FieldSpec(Kind.SEQ, "float", "[B, F] each reward function's score "
                               "(rlaudit/data/rewards.py); scores is then their combination"),
    "reward_mask": FieldSpec(Kind.SEQ, "bool", "[B, F] True where reward function f scored row i"),
}

REQUIRED_FIELDS = ("prompt_ids", "prompt_lengths", "response_ids", "response_lengths",
                   "response_mask", "uid")

_DTYPE_FAMILY = {
    "int": lambda d: not d.is_floating_point and not d.is_complex and d != torch.bool,
    "float": lambda d: d.is_floating_point,
    "bool": lambda d: d == torch.bool,
}


@dataclass(frozen=True)
class RolloutBatch:
    """A padded batch of trajectories. See the module docstring for the layout.

    ``tensors`` maps field name -> tensor (leading dim B); ``kinds`` gives each field's
    :class:`Kind`; ``meta`` is JSON-able provenance (engine, sampling params, ...).
    """

    tensors: Mapping[str, torch.Tensor]
    kinds: Mapping[str, Kind]
    meta: Mapping[str, object] = field(default_factory=dict)

    # ---- construction -------------------------------------------------------------------------
    @classmethod
    def from_tensors(cls, tensors: Mapping[str, torch.Tensor], *,
                     kinds: Mapping[str, Kind | str] | None = None,
                     meta: Mapping[str, object] | None = None,
                     source: str | None = None) -> "RolloutBatch":
        """Build and validate a batch. Known fields get their kind from :data:`KNOWN_FIELDS`;
        any other field needs an entry in ``kinds``."""
        kinds = {k: Kind(v) for k, v in (kinds or {}).items()}
        resolved: dict[str, Kind] = {}
        for name in tensors:
            if name in kinds:
                resolved[name] = kinds[name]
            elif name in KNOWN_FIELDS:
                resolved[name] = KNOWN_FIELDS[name].kind
            else:
                raise InputError(
                    "unknown field: give its kind (seq, prompt or token) in `kinds`",
                    source=source, key=name)
        batch = cls(dict(tensors), resolved, dict(meta or {}))
        batch.validate(source=source)
        return batch

    # ---- basic properties ---------------------------------------------------------------------
    @property
    def batch_size(self) -> int:
        return int(self.tensors["response_ids"].shape[0])

    def __len__(self) -> int:
        return self.batch_size

    @property
    def response_width(self) -> int:
        """R: padded response width."""
        return int(self.tensors["response_ids"].shape[1])

    @property
    def prompt_width(self) -> int:
        """P: padded prompt width."""
        return int(self.tensors["prompt_ids"].shape[1])

    def __getitem__(self, name: str) -> torch.Tensor:
        try:
            return self.tensors[name]
        except KeyError:
            raise InputError(f"batch has no field {name!r}; it has: {', '.join(sorted(self.tensors))}",
                             key=name) from None

    def get(self, name: str, default=None):
        return self.tensors.get(name, default)

    def __contains__(self, name: object) -> bool:
        return name in self.tensors

    def keys(self) -> list[str]:
        return list(self.tensors)

    def fields_of(self, kind: Kind) -> list[str]:
        return [k for k, v in self.kinds.items() if v == kind]

    @property
    def mask(self) -> torch.Tensor:
        """``response_mask`` as bool, [B, R]."""
        return self.tensors["response_mask"]

    def num_tokens(self) -> int:
        """Number of tokens with ``response_mask`` True (the token-mean denominator)."""
        return int(self.mask.sum())

    def sequence_lengths(self) -> torch.Tensor:
        """[B] int64: prompt + response length per row (what the model processes)."""
        return self.tensors["prompt_lengths"] + self.tensors["response_lengths"]

    # ---- functional updates -------------------------------------------------------------------
    def with_fields(self, kinds: Mapping[str, Kind | str] | None = None,
                    **tensors: torch.Tensor) -> "RolloutBatch":
        """A new batch with fields added or replaced (the old batch is untouched)."""
        new_kinds = dict(self.kinds)
        for name in tensors:
            if kinds and name in kinds:
                new_kinds[name] = Kind(kinds[name])
            elif name in self.kinds:
                pass
            elif name in KNOWN_FIELDS:
                new_kinds[name] = KNOWN_FIELDS[name].kind
            else:
                raise InputError("unknown field: give its kind", key=name)
        out = RolloutBatch({**self.tensors, **tensors}, new_kinds, dict(self.meta))
        out.validate_shapes()
        return out

    def without(self, *names: str) -> "RolloutBatch":
        return RolloutBatch({k: v for k, v in self.tensors.items() if k not in names},
                            {k: v for k, v in self.kinds.items() if k not in names}, dict(self.meta))

    def select(self, rows: torch.Tensor | Iterable[int]) -> "RolloutBatch":
        """Rows ``rows`` (indices, in that order) of every field. Widths (P, R) are kept."""
        idx = torch.as_tensor(list(rows) if not isinstance(rows, torch.Tensor) else rows,
                              dtype=torch.long)
        return RolloutBatch({k: v.index_select(0, idx) for k, v in self.tensors.items()},
                            dict(self.kinds), dict(self.meta))

    def clone(self) -> "RolloutBatch":
        return RolloutBatch({k: v.clone() for k, v in self.tensors.items()}, dict(self.kinds),
                            dict(self.meta))

    def to(self, device=None, dtype: torch.dtype | None = None) -> "RolloutBatch":
        """Move to ``device``; cast floating fields to ``dtype`` if given."""
        out = {}
        for k, v in self.tensors.items():
            v = v.to(device) if device is not None else v
            if dtype is not None and v.is_floating_point():
                v = v.to(dtype)
            out[k] = v
        return RolloutBatch(out, dict(self.kinds), dict(self.meta))

    def trim(self) -> "RolloutBatch":
        """Narrow P and R to the longest prompt/response actually present (at least 1 column)."""
        p = max(int(self.tensors["prompt_lengths"].max()), 1) if len(self) else 1
        r = max(int(self.tensors["response_lengths"].max()), 1) if len(self) else 1
        out = {}
        for k, v in self.tensors.items():
            kind = self.kinds[k]
            out[k] = v[:, :p] if kind == Kind.PROMPT else v[:, :r] if kind == Kind.TOKEN else v
        return RolloutBatch(out, dict(self.kinds), dict(self.meta))

    @staticmethod
    def concat(batches: list["RolloutBatch"]) -> "RolloutBatch":
        """Stack rows of batches with the same fields; narrower batches are right-padded
        (ids with each batch's pad value 0, masks False, floats 0)."""
        if not batches:
            raise ValueError("concat of no batches")
        names = list(batches[0].tensors)
        for b in batches[1:]:
            if set(b.tensors) != set(names):
                raise InputError(f"cannot concat batches with different fields: {sorted(names)} vs "
                                 f"{sorted(b.tensors)}")
        kinds = dict(batches[0].kinds)
        out = {}
        for name in names:
            ts = [b.tensors[name] for b in batches]
            if kinds[name] in (Kind.PROMPT, Kind.TOKEN):
                width = max(t.shape[1] for t in ts)
                ts = [pad_dim1(t, width) for t in ts]
            out[name] = torch.cat(ts, 0)
        return RolloutBatch(out, kinds, dict(batches[0].meta))

    # ---- validation ---------------------------------------------------------------------------
    def validate_shapes(self, *, source: str | None = None) -> None:
        """Leading dims agree; prompt/token fields have the batch's P/R as dim 1."""
        for name in REQUIRED_FIELDS:
            if name not in self.tensors:
                raise InputError("required field is missing", source=source, key=name)
        b, r, p = self.batch_size, self.response_width, self.prompt_width
        for name, t in self.tensors.items():
            kind = self.kinds.get(name)
            if kind is None:
                raise InputError("field has no kind", source=source, key=name)
            if t.dim() == 0 or t.shape[0] != b:
                raise InputError(f"expected leading dim B={b}, got shape {tuple(t.shape)}",
                                 source=source, key=name)
            if kind == Kind.TOKEN and (t.dim() < 2 or t.shape[1] != r):
                raise InputError(f"token field: expected shape [B={b}, R={r}, ...], got "
                                 f"{tuple(t.shape)}", source=source, key=name)
            if kind == Kind.PROMPT and (t.dim() < 2 or t.shape[1] != p):
                raise InputError(f"prompt field: expected shape [B={b}, P={p}, ...], got "
                                 f"{tuple(t.shape)}", source=source, key=name)

    def validate(self, *, source: str | None = None) -> None:
        """Full check: shapes, dtypes of known fields, length/mask consistency, finite floats.

        Raises :class:`InputError` naming ``source`` and the field.
        """
        self.validate_shapes(source=source)
        for name, t in self.tensors.items():
            spec = KNOWN_FIELDS.get(name)
            if spec is not None and not _DTYPE_FAMILY[spec.dtype](t.dtype):
                raise InputError(f"expected a {spec.dtype} tensor, got {t.dtype}", source=source,
                                 key=name)
            if spec is not None and spec.kind != self.kinds[name]:
                raise InputError(f"expected kind {spec.kind.value}, got {self.kinds[name].value}",
                                 source=source, key=name)
            if t.is_floating_point() and t.numel() and not bool(torch.isfinite(t).all()):
                bad = (~torch.isfinite(t)).nonzero()[0].tolist()
                raise InputError(f"non-finite value (NaN/inf) at index {bad}", source=source,
                                 key=name)
        b, r, p = self.batch_size, self.response_width, self.prompt_width
        pl, rl = self.tensors["prompt_lengths"], self.tensors["response_lengths"]
        if b and (int(pl.min()) < 1 or int(pl.max()) > p):
            raise InputError(f"prompt lengths must be in [1, P={p}], got [{int(pl.min())}, "
                             f"{int(pl.max())}]", source=source, key="prompt_lengths")
        if b and (int(rl.min()) < 0 or int(rl.max()) > r):
            raise InputError(f"response lengths must be in [0, R={r}], got [{int(rl.min())}, "
                             f"{int(rl.max())}]", source=source, key="response_lengths")
        beyond = torch.arange(r).unsqueeze(0) >= rl.unsqueeze(1)
        if bool((self.mask & beyond).any()):
            row = int((self.mask & beyond).any(1).nonzero()[0])
            raise InputError(f"response_mask is True past response_lengths (row {row})",
                             source=source, key="response_mask")
        check_combined_scores(self.tensors, self.meta, source=source)


def pad_dim1(t: torch.Tensor, width: int, value: float | int | bool = 0) -> torch.Tensor:
    """Right-pad ``t`` along dim 1 to ``width`` with ``value`` (a new tensor; ``t`` untouched)."""
    if t.shape[1] == width:
        return t.clone()
    if t.shape[1] > width:
        raise ValueError(f"cannot pad width {t.shape[1]} down to {width}")
    shape = list(t.shape)
    shape[1] = width - t.shape[1]
    return torch.cat([t, torch.full(shape, value, dtype=t.dtype, device=t.device)], 1)
