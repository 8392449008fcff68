"""Calling an adapter's stage under watch: no mutation of inputs, no aliasing of outputs
(the aliasing/mutation family; the stored-KL bug of slime PR #2114 is the model case).

Every stage check calls the adapter through :meth:`Guard.call`. The guard hands the stage fresh
copies of its inputs (so a stage that writes to its inputs cannot corrupt the inputs of later
checks, and the bug is charged to the no-mutation check only), then records, per stage:

- an input whose values or ``tensor._version`` changed (an in-place write, even one that wrote the
  same values back);
- an output that shares storage with an input (``untyped_storage().data_ptr()``): the caller's
  data and the stage's result are then one tensor, and the next in-place update corrupts both.

Outputs sharing storage with *each other* (verl returns one tensor as both advantages and
returns for outcome estimators) are recorded as a note, not a problem: nothing the caller gave
is at risk, and the value checks see any harm it does. Scalar outputs viewing one tensor
(metrics unpacked from a stacked vector) are not noted; metrics-are-copies checks whether such a
tensor is reused later.

Micro-batches returned by ``make_microbatches`` and the kept rows ``filter_groups`` returns may be
views of the input batch (most trainers slice rather than copy, and a filter that keeps every row
may return its input); for those stages only input mutation is checked.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Callable, Iterator

import torch

from rlaudit.data.batch import RolloutBatch

#: stages whose outputs may legitimately view their inputs
VIEWS_ALLOWED = frozenset({"make_microbatches", "filter_groups"})


class AdapterRaised(Exception):
    """The adapter's stage raised on valid input (a finding, not a crash of rlaudit)."""

    def __init__(self, stage: str, error: BaseException):
        self.stage, self.error = stage, error
        super().__init__(f"{stage} raised {type(error).__name__}: {error}")


def tensors_in(obj: Any, prefix: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """(path, tensor) for every tensor inside ``obj`` (tensors, RolloutBatch, dicts, lists,
    tuples; a nested tensor yields its packed values)."""
    if isinstance(obj, torch.Tensor):
        yield prefix or "output", obj.values() if obj.is_nested else obj
    elif isinstance(obj, RolloutBatch):
        for k, v in obj.tensors.items():
            yield from tensors_in(v, f"{prefix}.{k}" if prefix else k)
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from tensors_in(v, f"{prefix}[{k!r}]")
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from tensors_in(v, f"{prefix}[{i}]")


def _fresh(value: Any) -> Any:
    """A deep copy of tensors (grad-requiring leaves stay leaves that require grad)."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone().requires_grad_(value.requires_grad)
    if isinstance(value, RolloutBatch):
        return value.clone()
    return value


def _ptr(t: torch.Tensor) -> int | None:
    if t.numel() == 0:
        return None
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return None


class Guard:
    """Runs stage calls on fresh inputs and records mutation/aliasing problems per stage."""

    def __init__(self):
        self.problems: dict[str, list[str]] = defaultdict(list)
        self.notes: dict[str, list[str]] = defaultdict(list)
        self.calls: dict[str, int] = defaultdict(int)

    def call(self, stage: str, fn: Callable, *args, label: str = "", **kwargs):
        """``fn(*args, **kwargs)`` on fresh copies; returns ``(output, inputs_given)``.

        ``inputs_given`` is the dict of keyword inputs the stage actually saw (the copies), so a
        caller that checks gradients can read ``.grad`` of the leaves it passed. Exceptions the
        stage raises are re-raised as :class:`AdapterRaised` (NotImplementedError passes
        through unchanged: "not supported here")."""
        args = tuple(_fresh(a) for a in args)
        kwargs = {k: _fresh(v) for k, v in kwargs.items()}
        given = {**{f"arg{i}": a for i, a in enumerate(args)}, **kwargs}
        before = {path: (t.detach().clone(), t._version)
                  for path, t in tensors_in(given)}
        self.calls[stage] += 1
        try:
            out = fn(*args, **kwargs)
        except NotImplementedError:
            raise
        except (Exception, SystemExit) as e:  # the stage's own failure (exit() too) is the finding
            raise AdapterRaised(stage, e) from e
        where = f" ({label})" if label else ""
        for path, t in tensors_in(given):
            val, version = before[path]
            changed = t._version != version or not torch.equal(t.detach(), val)
            if changed:
                self.problems[stage].append(f"input {path} modified in place{where}")
        if stage not in VIEWS_ALLOWED:
            self._aliasing(stage, given, out, where)
        return out, given

    def _aliasing(self, stage: str, given: dict, out: Any, where: str) -> None:
        in_ptrs = {}
        for path, t in tensors_in(given):
            p = _ptr(t)
            if p is not None:
                in_ptrs.setdefault(p, path)
        seen_out: dict[int, str] = {}
        for path, t in tensors_in(out):
            p = _ptr(t)
            if p is None:
                continue
            if p in in_ptrs:
                self.problems[stage].append(
                    f"output {path} shares storage with input {in_ptrs[p]}{where}")
            elif t.numel() == 1:
                continue    # scalars viewing one fresh tensor (stacked metrics) are harmless
            elif p in seen_out:
                self.notes[stage].append(f"outputs {seen_out[p]} and {path} share storage")
            else:
                seen_out[p] = path


def batch_state(batch: RolloutBatch) -> dict:
    """Copies and version counters of every tensor of ``batch``."""
    return {k: (v.detach().clone(), v._version) for k, v in batch.tensors.items()}


def unchanged_since(batch: RolloutBatch, before: dict) -> bool:
    """Every tensor still has the values and version counter :func:`batch_state` recorded."""
    for k, (val, version) in before.items():
        t = batch.tensors.get(k)
        if t is None or t._version != version or not torch.equal(t.detach(), val):
            return False
    return True
