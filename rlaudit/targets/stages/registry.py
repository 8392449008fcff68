"""The stage-check registry and what every check is handed: an adapter's stage functions against
the reference, metamorphic relations and no-mutation, on the deterministic inputs of
:mod:`rlaudit.targets.inputs.cases`.

Each check is registered under ``"<stage>:<property>"`` with its family (docs/targets.md, the
check table) and gives one :class:`~rlaudit.verdict.result.CheckResult` for the adapter: ``fail`` with the first
problems (case, name, worst token), ``n/a`` when the stage is not provided or every name it was
asked about is declared or raised as not implemented (``NotImplementedError``), ``unsupported``
when nothing ran and the adapter said the release lacks what was needed
(:class:`~rlaudit.verdict.unsupported.UnsupportedFeature`), ``pass`` otherwise.
:func:`run_stage_checks` runs them all and returns the pseudo-scenario ``"stages"``.

The checks live one module per family beside this one (``advantage.py``, ``agg.py``,
``batch.py``, ``filter.py``, ``loss.py``, ``identity.py``, ``mutation.py``); ``suite.py`` runs
them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from rlaudit.targets.contract.adapter import NOT_SUPPORTED, STAGES, adapter_name, supported_names
from rlaudit.targets.contract.declare import Declarations, read_declarations, scaled
from rlaudit.targets.contract.guard import AdapterRaised, Guard
from rlaudit.targets.inputs.cases import Case, default_cases
from rlaudit.verdict.result import DIFFERS, FAIL, NA, PASS, CheckResult
from rlaudit.verdict.tensors import compare_tensors
from rlaudit.verdict.tolerance import Tolerance
from rlaudit.verdict.unsupported import UnsupportedFeature, unsupported_result


#: float64 comparisons of the same formula computed in another order
STAGE_TOL = Tolerance(rtol=1e-7, atol=1e-9)
#: problems quoted in a failure message (the rest are counted)
MAX_QUOTED = 3


@dataclass(frozen=True)
class StageCheck:
    name: str
    stage: str
    family: str
    fn: Callable[["StageEnv"], CheckResult]
    doc: str


#: filled as the check modules are imported: read it through
#: :func:`rlaudit.targets.stages.suite.stage_checks`, which imports them all (a caller that read
#: this dict directly saw whichever modules happened to be loaded)
STAGE_CHECKS: dict[str, StageCheck] = {}


def stage_check(stage: str, prop: str, family: str):
    """Register ``fn(env) -> CheckResult`` as check ``"<stage>:<prop>"``."""
    assert stage in STAGES, stage

    def deco(fn):
        name = f"{stage}:{prop}"
        STAGE_CHECKS[name] = StageCheck(name, stage, family, fn, (fn.__doc__ or "").strip())
        return fn

    return deco


@dataclass
class StageEnv:
    """What a check needs: the adapter, its validated declarations, the guard its calls go
    through, the inputs."""

    adapter: object
    guard: Guard = field(default_factory=Guard)
    cases: list[Case] = field(default_factory=default_cases)
    model_path: str | None = None
    decl: Declarations | None = None
    #: what a caller varies beyond ``cases`` (rlaudit/targets/fuzz/stage_fuzz.py); empty: the fixed
    #: inputs and settings. Keys: ``clip_settings``, ``estimator_settings``, ``kl_coef``,
    #: ``layouts``, ``microbatch_inputs``, ``filter_inputs``; and a declared-names attribute
    #: (``loss_modes``, ``loss_agg_modes``, ``advantage_estimators``, ``kl_estimators``,
    #: ``distill_losses``) mapped to the names the checks are narrowed to.
    overrides: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.decl is None:
            self.decl = read_declarations(self.adapter)

    def setting(self, key: str, default):
        """``overrides[key]`` if given, else ``default`` (the check's fixed setting)."""
        return self.overrides.get(key, default)

    def names(self, attr: str, reference, *, key: str | None = None) -> list[str]:
        """The names the adapter implements (:func:`supported_names`), narrowed to
        ``overrides[attr]`` when given."""
        names = supported_names(self.adapter, attr, reference, key=key)
        only = self.overrides.get(attr)
        return names if only is None else [n for n in names if n in only]

    @property
    def name(self) -> str:
        return adapter_name(self.adapter)

    def tally(self, check: str) -> "Tally":
        """A Tally for ``check`` with the adapter's tolerance and declared differences."""
        return Tally(check, self.name, tol=self.decl.stage_tolerance(check), decl=self.decl)

    def conventions(self, check: str) -> dict[str, str]:
        """Conventions the reference computes under for ``check`` (declared differences)."""
        return self.decl.conventions(check)

    def call(self, stage: str, *args, label: str = "", **kwargs):
        """The adapter's ``stage`` through the guard: ``(output, inputs_given)``."""
        return self.guard.call(stage, getattr(self.adapter, stage), *args, label=label, **kwargs)


class Tally:
    """Accumulates one check's problems, skipped names and count of comparisons made.

    ``tol``: the check's tolerance (the adapter's declared precision or override; atol scaled by the
    magnitude of each compared quantity). ``decl``: the adapter's declarations; a problem covered by
    a declared :class:`~rlaudit.targets.contract.declare.Difference` is recorded as declared, not as
    a problem, and the check reports ``differs`` if nothing else failed."""

    def __init__(self, check: str, backend: str, *, tol: Tolerance = STAGE_TOL,
                 decl: Declarations | None = None):
        self.check, self.backend, self.tol, self.decl = check, backend, tol, decl
        self.problems: list[str] = []
        self.declared: dict[str, list[str]] = {}
        self.skipped: dict[str, str] = {}
        #: name -> the adapter's UnsupportedFeature: what this release could not run
        self.unsupported: dict[str, UnsupportedFeature] = {}
        self.checked = 0
        self.drift = 0.0

    def _problem(self, msg: str) -> None:
        diff = self.decl.declared(self.check, msg) if self.decl is not None else None
        if diff is None:
            self.problems.append(msg)
        else:
            self.declared.setdefault(diff.name, []).append(msg)

    def compare(self, what: str, got, want, mask=None, tol: Tolerance | None = None) -> bool:
        """Elementwise comparison on ``mask`` (valid tokens); records a problem on mismatch."""
        self.checked += 1
        if not isinstance(got, torch.Tensor):
            try:
                got = torch.as_tensor(float(got), dtype=torch.float64)
            except (TypeError, ValueError):
                self._problem(f"{what}: expected a tensor or number, got "
                              f"{type(got).__name__}")
                return False
        want = torch.as_tensor(want, dtype=torch.float64).detach()
        got = got.detach().double()
        if got.shape != want.shape and got.numel() == want.numel() == 1:
            got = got.reshape(want.shape)     # a [1] loss where a scalar is expected
        if got.shape == want.shape:
            # compare_tensors lets NaN through (NaN > bound is False): catch it here
            valid = torch.ones_like(want, dtype=torch.bool) if mask is None else mask.bool()
            bad = valid & ~torch.isfinite(got) & torch.isfinite(want)
            if bool(bad.any()):
                where = [int(i) for i in bad.nonzero()[0]]
                self._problem(f"{what}: {int(bad.sum())} non-finite value(s), first at "
                              f"{where} (expected {float(want[tuple(where)]):.6g})")
                return False
            rel = (got - want).abs() / want.abs().clamp_min(1e-12)
            rel = torch.where(valid & torch.isfinite(rel), rel, 0.0)
            self.drift = max(self.drift, float(rel.max()) if rel.numel() else 0.0)
        tol = scaled(tol or self.tol, want, mask if got.shape == want.shape else None)
        ok, msg, _ = compare_tensors(what, got, want, tol, mask)
        if not ok:
            self._problem(msg)
        return ok

    def fail(self, msg: str) -> None:
        self._problem(msg)

    def skip(self, name: str, why: str) -> None:
        self.skipped[name] = why

    def lacks(self, name: str, error: UnsupportedFeature) -> None:
        """``name`` could not run: the release lacks a feature (listed with the skipped ones)."""
        self.skipped[name] = str(error)
        self.unsupported[name] = error

    def result(self, what: str) -> CheckResult:
        skipped = (f"; skipped (not supported): {', '.join(sorted(self.skipped))}"
                   if self.skipped else "")
        details = {"skipped": self.skipped} if self.skipped else {}
        details["tolerance"] = {"rtol": self.tol.rtol, "atol": self.tol.atol}
        tol = f" [rtol={self.tol.rtol:g}, atol={self.tol.atol:g} x magnitude]"
        if self.declared:
            details["differences"] = {
                name: {"problems": msgs[:10], "count": len(msgs),
                       "declared": next(d.describe() for d in self.decl.differences
                                        if d.name == name)}
                for name, msgs in self.declared.items()}
        if self.problems:
            more = len(self.problems) - MAX_QUOTED
            msg = "; ".join(self.problems[:MAX_QUOTED]) + (f" (+{more} more)" if more > 0 else "")
            return CheckResult(self.check, self.backend, FAIL, msg + tol,
                               {**details, "problems": self.problems[:50]}, self.drift)
        if self.unsupported:
            details["unsupported"] = {n: e.details() for n, e in self.unsupported.items()}
        if not self.checked and self.unsupported:
            res = unsupported_result(self.check, self.backend, self.unsupported)
            res.details = {**details, **res.details}
            return res
        if not self.checked:
            return CheckResult(self.check, self.backend, NA,
                               f"nothing to check{skipped or ''}", details)
        if self.declared:
            parts = [f"{name} ({len(msgs)} comparison(s), e.g. {msgs[0]})"
                     for name, msgs in self.declared.items()]
            return CheckResult(self.check, self.backend, DIFFERS,
                               "as declared: " + "; ".join(parts) + tol, details, self.drift)
        return CheckResult(self.check, self.backend, PASS, f"{self.checked} {what}{skipped}{tol}",
                           details, self.drift)


def attempt(tally: Tally, name: str, fn: Callable[[], None], *, skip_as: str | None = None
            ) -> None:
    """Run one comparison; a stage saying NotImplementedError marks ``skip_as`` (default
    ``name``) skipped (UnsupportedFeature: unsupported by the release); a stage raising
    anything else is a failure naming the case."""
    try:
        fn()
    except UnsupportedFeature as e:
        tally.lacks(skip_as or name, e)
    except NOT_SUPPORTED as e:
        tally.skip(skip_as or name, str(e) or "NotImplementedError")
    except AdapterRaised as e:
        tally.fail(f"{name}: {e}")
