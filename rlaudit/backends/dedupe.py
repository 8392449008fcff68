"""Replay each distinct variant once per backend.

A scenario's invariants each ask for the runs they compare, by name, and different invariants
often ask for the same run under two names: ``microbatch-invariance``'s baseline ``base:short``
(the scenario's config, at most two steps) *is* ``base`` when the scenario has two steps or
fewer; an ``onpolicy`` variant is ``base`` when the scenario has one step; a ``cfg:agg:MODE``
variant is ``onpolicy`` when MODE is the scenario's own. Over the 31 shipped scenarios, 86 of 618
scenario x backend x variant replays repeat another under a new name -- on the multi-rank
backends, each of them a full replay of the same inputs through the same code.

:func:`replay_distinct` sends a backend each distinct variant once and hands every other name a
deep copy of its twin's run (renamed): the check list, the names every invariant reads and the
values it reads are those of a separate replay, since a replay is a function of what goes in.
"Distinct" is judged on everything a backend is given per variant (:func:`variant_digest`: the
config, steps, the batch's tensors, kinds and meta) plus the test-only fault injectors that apply
to the variant by name (``$RLAUDIT_FAULT``, rlaudit/backends/faults.py): a fault aimed at
``base`` makes ``base`` and ``base:short`` two replays. The config's ``critic`` section counts
only when a critic is used (``adv_estimator: gae``; :func:`rlaudit.config.replayed_dict`), and
``microbatch:1`` (actor and critic micro-batches of one row) is ``base`` in a scenario whose
actor micro-batches are one row already (drgrpo_sum_norm, ppo_dual_clip). A probe re-run (drift
localisation) or a batch that cannot be digested is always replayed. The reference backend keeps
its own memo (rlaudit/backends/memo.py), across requests; this works within one request, on every
backend.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
from typing import Callable

from rlaudit.backends import faults
from rlaudit.backends.base import ReplayRequest, Variant, VariantRun
from rlaudit.config import replayed_dict
from rlaudit.data.io import rollout_sha256


def variant_digest(variant: Variant) -> str | None:
    """sha256 of what a replay of ``variant`` depends on besides the request's model, dtype,
    device and layout: config, steps, batch tensors (``rollout_sha256``), kinds and meta. None
    for a probe re-run or a batch that cannot be digested (e.g. a nested tensor)."""
    if variant.probe is not None:
        return None
    head = {"steps": variant.steps, "config": replayed_dict(variant.config),
            "kinds": {k: str(v) for k, v in variant.batch.kinds.items()},
            "meta": variant.batch.meta}
    try:
        head["batch"] = rollout_sha256(variant.batch)
        text = json.dumps(head, sort_keys=True, default=repr)
    except (RuntimeError, TypeError, ValueError):
        return None
    return hashlib.sha256(text.encode()).hexdigest()


def distinct(variants: list[Variant], *, backend: str, fault_spec: str = ""
             ) -> tuple[list[Variant], dict[str, str]]:
    """``(variants to replay, {name: name of the replayed twin})``, in the given order."""
    first: dict[tuple, str] = {}
    keep, aliases = [], {}
    for v in variants:
        digest = variant_digest(v)
        if digest is None:
            keep.append(v)
            continue
        key = (digest, tuple(map(repr, faults.applying(fault_spec, backend, v.name))))
        if key in first:
            aliases[v.name] = first[key]
        else:
            first[key] = v.name
            keep.append(v)
    return keep, aliases


def expand(runs: dict[str, VariantRun], aliases: dict[str, str], names: list[str]
           ) -> dict[str, VariantRun]:
    """``runs`` with every alias filled in by a renamed deep copy of its twin's run, keyed in
    the order of ``names`` (the request's variants)."""
    out = {}
    for name in names:
        twin = aliases.get(name)
        if twin is None:
            if name in runs:
                out[name] = runs[name]
        elif twin in runs:
            run = copy.deepcopy(runs[twin])
            run.name = name
            out[name] = run
    return out


def replay_distinct(replay: Callable[..., dict[str, VariantRun]], backend,
                    request: ReplayRequest) -> dict[str, VariantRun]:
    """``replay(backend, request)`` with each distinct variant replayed once (module docstring);
    the result has a run under every variant name of ``request``."""
    keep, aliases = distinct(request.variants, backend=backend.name, fault_spec=request.faults)
    if not aliases:
        return replay(backend, request)
    runs = replay(backend, dataclasses.replace(request, variants=keep))
    return expand(runs, aliases, [v.name for v in request.variants])
