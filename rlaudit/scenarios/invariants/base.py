"""The invariant registry and the context invariants read.

An invariant has a name, a family (ARCHITECTURE.md's ten), a docstring with the math, a
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
from rlaudit.config import Config, from_dict, to_dict
from rlaudit.data.batch import RolloutBatch
from rlaudit.scenarios.result import FAIL, NA, PASS, CheckResult
from rlaudit.scenarios.spec import Scenario, Tolerance


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


INVARIANTS: Registry = Registry("invariant")


def invariant(name: str, family: str, *, variants=None, partial: bool = False):
    """Register ``check`` (whose docstring is the invariant's documentation)."""

    def deco(check):
        inv = Invariant(name=name, family=family, check=check,
                        variants=variants or (lambda scn, batch: []),
                        doc=(check.__doc__ or "").strip(), partial=partial)
        INVARIANTS.register(name)(inv)
        return check

    return deco


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


def rel_diff(got: torch.Tensor | float, want: torch.Tensor | float) -> float:
    """max |got - want| / max(|want|, tiny) over elements."""
    got = torch.as_tensor(got, dtype=torch.float64)
    want = torch.as_tensor(want, dtype=torch.float64)
    if got.numel() == 0:
        return 0.0
    return float(((got - want).abs() / want.abs().clamp_min(1e-12)).max())


def compare_tensors(name: str, got: torch.Tensor, want: torch.Tensor, tol: Tolerance,
                    mask: torch.Tensor | None = None, *, top: int = 3,
                    slack: torch.Tensor | float = 0.0) -> tuple[bool, str, dict]:
    """Elementwise |got - want| <= atol + rtol*|want| + slack where ``mask``; message names the
    worst (row, token) entries. ``slack`` (a scalar or a tensor like ``want``): a measured noise
    floor (rlaudit.scenarios.invariants.compare.NOISE_FACTOR)."""
    got = got.double()
    want = want.double()
    if got.shape != want.shape:
        return False, f"{name}: shape {tuple(got.shape)} != {tuple(want.shape)}", {}
    # the passing case in few full-size operations (a model's parameters: 56 compares of 364k
    # entries in kl_k1); err > bound is err - bound > 0 for every pair of doubles
    err = (got - want).abs_()
    bound = want.abs().mul_(tol.rtol).add_(tol.atol).add_(slack)
    bad = err > bound
    # NaN/inf where the expectation is finite is a failure (NaN > bound is False)
    if not bool(torch.isfinite(got).all()):
        bad |= ~torch.isfinite(got) & torch.isfinite(want)
    if mask is not None:
        mask = mask.bool()
        bad &= mask
        err_in = torch.where(mask, err, torch.zeros_like(err))
    else:
        err_in = err
    worst_abs = float(err_in.max()) if got.numel() else 0.0
    details = {"max_abs_diff": worst_abs}
    if not bool(bad.any()):
        return True, f"{name}: max |diff| {worst_abs:.3g}", details
    # the worst first, among the entries out of tolerance only (an entry whose expectation is
    # NaN is never one); a non-finite entry counts as infinitely far out
    excess = (err - bound).nan_to_num(nan=float("inf"), posinf=float("inf"))
    flat = torch.where(bad, excess, -float("inf")).flatten()
    idx = torch.topk(flat, min(top, int(bad.sum()))).indices
    worst = []
    for i in idx.tolist():
        pos = list(torch.unravel_index(torch.tensor(i), got.shape))
        pos = [int(p) for p in pos]
        worst.append({"index": pos, "got": float(got.flatten()[i]), "want": float(want.flatten()[i])})
    details["worst"] = worst
    # how many times its bound the farthest entry is off (a near miss of a measured noise
    # floor is measured again: rlaudit/targets/runner.py); inf for a zero bound or non-finite
    ratio = torch.where(bad, err / bound, 0.0).nan_to_num(nan=float("inf"))
    details["missed_by"] = float(ratio.max())
    w = worst[0]
    floor = ""
    if isinstance(slack, torch.Tensor) or slack:
        floor = f", noise floor up to {float(torch.as_tensor(slack).max()):.2g}"
    return False, (f"{name}: {int(bad.sum())} entries out of tolerance (rtol={tol.rtol:g}, "
                   f"atol={tol.atol:g}{floor}); worst at {w['index']}: {w['got']:.6g} vs "
                   f"{w['want']:.6g}"), details


def result(inv: str, backend: str, ok: bool, message: str, details=None, drift=None) -> CheckResult:
    return CheckResult(inv, backend, PASS if ok else FAIL, message, details or {}, drift)


def not_applicable(inv: str, backend: str, why: str) -> CheckResult:
    return CheckResult(inv, backend, NA, why)
