"""Validating a target before anything runs (``rlaudit run --target``): the adapter loads, each
stage it provides can be called as the contract calls it, and every named scenario or stage case
is readable. Problems are raised together (exit 2).
"""

from __future__ import annotations

import inspect
from pathlib import Path

from rlaudit.errors import InputError, InputErrors, Problems, raise_problems
from rlaudit.scenarios.validate import HEADER, validate_invocation
from rlaudit.targets.contract.adapter import STAGES
from rlaudit.targets.contract.load import load_adapter
from rlaudit.targets.contract.stages import Stages
from rlaudit.targets.run.found import is_stage_case, load_stage_case


def stage_contract() -> dict[str, tuple[list[str], list[str]]]:
    """stage -> (positional parameters, required keyword parameters), read with
    :func:`inspect.signature` from :class:`~rlaudit.targets.contract.stages.Stages` (the one
    place they are written down); parameters with a default there are optional."""
    out = {}
    for name in STAGES:
        params = list(inspect.signature(getattr(Stages, name)).parameters.values())[1:]  # self
        required = [p for p in params if p.default is p.empty]
        out[name] = ([p.name for p in required if p.kind is not p.KEYWORD_ONLY],
                     [p.name for p in required if p.kind is p.KEYWORD_ONLY])
    return out


def adapter_problems(adapter: object, source: str) -> list[InputError]:
    """Each provided stage must accept the contract's required arguments (positional ones by
    position, the rest by keyword): a stage that cannot take them is found here, not as a
    TypeError in the middle of the checks. Parameters of the stage beyond the contract are not
    judged (the checks pass some optional ones, e.g. ``response_lengths``, when accepted)."""
    problems = []
    for stage, (positional, keyword) in stage_contract().items():
        fn = getattr(adapter, stage, None)
        if fn is None:
            continue
        if not callable(fn):
            problems.append(InputError(f"expected a method, got {type(fn).__name__}",
                                       source=source, key=stage))
            continue
        try:
            sig = inspect.signature(fn)
        except (TypeError, ValueError):
            continue  # a builtin or C callable: nothing to check up front
        try:
            sig.bind_partial(*positional, **{k: None for k in keyword})
        except TypeError as e:
            call = ", ".join([*positional, "*", *keyword]) if keyword else ", ".join(positional)
            problems.append(InputError(f"cannot be called as the contract calls it, "
                                       f"{stage}({call}): {e} (its signature: {stage}{sig})",
                                       source=source, key=stage))
    return problems


def validate_target(spec: str, paths: list[Path]) -> object:
    """``rlaudit run --target``: load the adapter (``module:Attr`` or a peer's name), check its
    stages' signatures and every named scenario's inputs; return the adapter or raise every
    problem together."""
    adapter = load_adapter(spec)
    problems = Problems()
    for p in adapter_problems(adapter, spec):
        problems.take(p)
    # stage cases written by `rlaudit fuzz` (scenarios/found/) are read as such, not as scenarios
    for path in [p for p in paths if is_stage_case(p)]:
        try:
            load_stage_case(path)
        except InputError as e:
            problems.take(e)
    paths = [p for p in paths if not is_stage_case(p)]
    try:
        validate_invocation(paths)
    except InputErrors as e:
        for p in e.problems:
            problems.take(p)
    except InputError as e:
        problems.take(e)
    raise_problems(problems.items, header=HEADER)
    return adapter
