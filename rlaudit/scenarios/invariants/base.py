"""The invariant registry and the context invariants read.

An invariant has a name, a family (metamorphic, identity, parity, ...: ``rlaudit list
invariants``, docs/scenarios.md), a docstring with the math, a
``variants`` hook that asks for the extra runs it needs (re-cut batch, permuted rows, a flipped
flag, ...), and a ``check`` that turns the runs of every backend into CheckResults.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Callable

import torch

from rlaudit.algo.registry import Registry
from rlaudit.backends.base import Variant, VariantRun
from rlaudit.config import Config
from rlaudit.dicts import from_dict, to_dict
from rlaudit.data.batch import RolloutBatch
from rlaudit.scenarios.spec import Scenario
from rlaudit.verdict.result import FAIL, NA, PASS, CheckResult


@dataclass
class CheckContext:
    scenario: Scenario
    batch: RolloutBatch                               # the baseline batch
    runs: dict[str, dict[str, VariantRun]]            # backend -> variant name -> run
    errors: dict[str, str] = field(default_factory=dict)
    variants: list[Variant] = field(default_factory=list)

    def variant(self, name: str) -> Variant | None:
        return next((v for v in self.variants if v.name == name), None)

    def batch_of(self, variant: str) -> RolloutBatch:
        """The batch ``variant`` ran on (variants may permute rows, widen or perturb it); the
        baseline batch for a name that is not a variant."""
        v = self.variant(variant)
        return self.batch if v is None else v.batch

    def mask(self, variant: str) -> torch.Tensor:
        """The response mask of the batch ``variant`` ran on: every per-token tensor of that
        variant's runs is read under it, never under the baseline's."""
        return self.batch_of(variant).mask

    def backends(self) -> list[str]:
        return list(self.runs)

    def run(self, backend: str, variant: str = "base") -> VariantRun | None:
        """The run, or None when the backend did not run it or could not (``info["unsupported"]``:
        e.g. a critic on a backend without one)."""
        run = self.runs.get(backend, {}).get(variant)
        if run is None or run.info.get("unsupported"):
            return None
        return run

    def need(self, invariant: str, backend: str, *variants: str
             ) -> tuple[list[VariantRun] | None, CheckResult | None]:
        """(runs, None) when every variant ran on ``backend``, else (None, an n/a result saying
        which did not and why)."""
        runs = [self.run(backend, v) for v in variants]
        if all(r is not None for r in runs):
            return runs, None
        why = []
        for v, r in zip(variants, runs):
            if r is None:
                raw = self.runs.get(backend, {}).get(v)
                reason = raw.info.get("unsupported") if raw is not None else "not run"
                why.append(f"{v}: {reason}")
        return None, not_applicable(invariant, backend, "; ".join(why))


@dataclass
class Invariant:
    name: str
    family: str
    check: Callable[[CheckContext], list[CheckResult]]
    variants: Callable[[Scenario, RolloutBatch], list[Variant]] = lambda scn, batch: []
    doc: str = ""
    partial: bool = False
    """Its variants are alternatives (each compared with the baseline on its own): a backend
    that cannot run some of them is still checked on the others (named in the message)."""
    alternatives: bool = False
    """Its variants are alternatives without a baseline (each checked on its own, e.g. one per
    IS level): a backend is checked on whichever it ran, one is enough; the others are named
    n/a in the message."""
    trigger: Callable[[Scenario], str | None] | None = None
    """What must be on in a scenario for the check to say anything: returns why it is off (the
    check is then n/a on every backend with that reason, never a pass), None when it is on."""

    def applies(self, scn: Scenario) -> str | None:
        """Why this invariant's trigger is off in ``scn`` (None: on, or no trigger)."""
        return self.trigger(scn) if self.trigger is not None else None


INVARIANTS: Registry = Registry("invariant")


def invariant(name: str, family: str, *, variants=None, partial: bool = False,
              alternatives: bool = False, trigger=None):
    """Register ``check`` (whose docstring is the invariant's documentation). ``trigger``:
    ``(scenario) -> why it is off | None`` (:attr:`Invariant.trigger`)."""

    def deco(check):
        def gated(ctx: CheckContext) -> list[CheckResult]:
            why = trigger(ctx.scenario) if trigger is not None else None
            if why:
                return [not_applicable(name, b, why) for b in ctx.backends()]
            return check(ctx)

        inv = Invariant(name=name, family=family, check=gated,
                        variants=variants or (lambda scn, batch: []),
                        doc=(check.__doc__ or "").strip(), partial=partial,
                        alternatives=alternatives, trigger=trigger)
        INVARIANTS.register(name)(inv)
        return check

    return deco


def catalogue_section() -> list[dict]:
    """The "invariants" section of rlaudit.catalogue's name cache: name, family and doc of every
    registered invariant (complete once rlaudit.scenarios.invariants has imported its modules)."""
    return [{"name": n, "family": INVARIANTS.get(n).family, "doc": INVARIANTS.get(n).doc}
            for n in INVARIANTS]


# ---- helpers shared by invariant modules ------------------------------------------------------

def with_overrides(cfg: Config, **dotted) -> Config:
    """A copy of ``cfg`` with dotted keys replaced: with_overrides(cfg, **{"actor.entropy_coeff": 0})."""
    data = to_dict(cfg)
    for key, value in dotted.items():
        node = data
        parts = key.split(".")
        for p in parts[:-1]:
            node = node[p]
        node[parts[-1]] = value
    return from_dict(Config, data)


def base_variant(scn: Scenario, batch: RolloutBatch, name: str, *, steps: int = 1,
                 **overrides) -> Variant:
    cfg = with_overrides(scn.config, **overrides) if overrides else dataclasses.replace(scn.config)
    return Variant(name=name, config=cfg, batch=batch, steps=steps)


def result(inv: str, backend: str, ok: bool, message: str, details=None, drift=None) -> CheckResult:
    return CheckResult(inv, backend, PASS if ok else FAIL, message, details or {}, drift)


def not_applicable(inv: str, backend: str, why: str) -> CheckResult:
    return CheckResult(inv, backend, NA, why)
