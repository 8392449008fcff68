"""Stage-level checks: an adapter's stage functions against the reference, metamorphic relations
and no-mutation, on the deterministic inputs of :mod:`rlaudit.targets.cases`.

Each check is registered under ``"<stage>:<property>"`` with an ARCHITECTURE.md family and gives
one :class:`~rlaudit.scenarios.result.CheckResult` for the adapter: ``fail`` with the first
problems (case, name, worst token), ``n/a`` when the stage is not provided or every name it was
asked about is declared or raised as unsupported (``NotImplementedError``), ``pass`` otherwise.
:func:`run_stage_checks` runs them all and returns the pseudo-scenario ``"stages"``.

The math stages' checks live here; micro-batching and train_step checks in ``batch_checks.py``,
policy-loss and distillation checks in ``loss_checks.py``.
"""

from __future__ import annotations

import time
import traceback
from dataclasses import dataclass, field
from typing import Callable

import torch

from rlaudit.algo import advantages as ref_adv
from rlaudit.algo.agg import AGG_MODES, Denominators, agg_loss
from rlaudit.algo.kl import DEFAULT_K3_CLAMP, KL_ESTIMATORS, kl_penalty
from rlaudit.algo.reward import apply_kl_in_reward
from rlaudit.errors import InputError
from rlaudit.scenarios.invariants.base import compare_tensors
from rlaudit.scenarios.result import DIFFERS, ERROR, FAIL, NA, PASS, CheckResult, ScenarioResult
from rlaudit.scenarios.spec import Tolerance
from rlaudit.targets.adapter import (NOT_SUPPORTED, STAGES, accepts, adapter_name, has_stage,
                                     supported_names)
from rlaudit.targets.declare import Declarations, scaled, validate
from rlaudit.targets.cases import (FLOAT_FIELDS, Case, default_cases, fixed_permutation, split_rows,
                                   with_garbage)
from rlaudit.targets.guard import AdapterRaised, Guard

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


#: filled as the check modules are imported: read it through :func:`stage_checks`, which imports
#: them all (a caller that read this dict directly saw whichever modules happened to be loaded)
STAGE_CHECKS: dict[str, StageCheck] = {}


def stage_checks() -> dict[str, StageCheck]:
    """Every registered stage check, by name: the modules that register them are imported first."""
    from rlaudit.targets import (batch_checks, filter_checks,  # noqa: F401  (register
                                 identity_checks, loss_checks)  # their checks)
    return STAGE_CHECKS


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
    #: what a caller varies beyond ``cases`` (rlaudit/targets/fuzz.py); empty: the fixed inputs
    #: and settings. Keys: ``clip_settings``, ``estimator_settings``, ``kl_coef``, ``layouts``,
    #: ``microbatch_inputs``, ``filter_inputs``; and a declared-names attribute (``loss_modes``,
    #: ``loss_agg_modes``, ``advantage_estimators``, ``kl_estimators``, ``distill_losses``)
    #: mapped to the names the checks are narrowed to.
    overrides: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.decl is None:
            self.decl = validate(self.adapter)

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

    ``tol``: the check's tolerance (the adapter's declared precision or override; atol scaled
    by the magnitude of each compared quantity). ``decl``: the adapter's declarations; a
    problem covered by a declared :class:`~rlaudit.targets.declare.Difference` is recorded as
    declared, not as a problem, and the check reports ``differs`` if nothing else failed."""

    def __init__(self, check: str, backend: str, *, tol: Tolerance = STAGE_TOL,
                 decl: Declarations | None = None):
        self.check, self.backend, self.tol, self.decl = check, backend, tol, decl
        self.problems: list[str] = []
        self.declared: dict[str, list[str]] = {}
        self.skipped: dict[str, str] = {}
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
    ``name``) skipped; a stage raising anything else is a failure naming the case."""
    try:
        fn()
    except NOT_SUPPORTED as e:
        tally.skip(skip_as or name, str(e) or "NotImplementedError")
    except AdapterRaised as e:
        tally.fail(f"{name}: {e}")


def _grad_of(out: torch.Tensor, leaf: torch.Tensor, mask: torch.Tensor | None = None):
    """d(sum of ``out`` over ``mask``)/d``leaf`` (zeros when ``out`` does not depend on it)."""
    if not isinstance(out, torch.Tensor):
        raise AdapterRaised("the stage", TypeError(
            f"expected a differentiable tensor, got {type(out).__name__}"))
    total = out.sum() if mask is None else torch.where(mask, out, 0.0).sum()
    if not total.requires_grad:
        return torch.zeros_like(leaf)
    (g,) = torch.autograd.grad(total, leaf, allow_unused=True)
    return torch.zeros_like(leaf) if g is None else g


# ---- advantages ------------------------------------------------------------------------------

#: estimator -> keyword settings exercised (gamma/lam below 1 so discounting shows)
#: conventions compute_advantages takes (rlaudit.targets.declare.CONVENTIONS)
ADV_CONVENTIONS = ("outcome_score", "grpo_std_eps")
#: estimators that score whole rows (the outcome_score convention applies to them)
OUTCOME_ESTIMATORS = ("grpo", "drgrpo", "rloo", "reinforce_plus_plus_baseline")

ESTIMATOR_SETTINGS = {
    "gae": [dict(gamma=0.9, lam=0.95)],
    "reinforce_plus_plus": [dict(gamma=0.9)],
    "grpo": [dict(norm_adv_by_std_in_grpo=True), dict(norm_adv_by_std_in_grpo=False)],
}


def _adv_kwargs(case: Case, estimator: str, setting: dict) -> dict:
    return dict(estimator=estimator, token_level_rewards=case["token_level_rewards"],
                response_mask=case.mask, uid=case["uid"], values=case["values"],
                gamma=setting.get("gamma", 1.0), lam=setting.get("lam", 1.0),
                norm_adv_by_std_in_grpo=setting.get("norm_adv_by_std_in_grpo", True))


def _adv_runs(env: StageEnv):
    """(label, estimator, setting) for every supported estimator and its settings."""
    settings = env.setting("estimator_settings", ESTIMATOR_SETTINGS)
    for est in env.names("advantage_estimators", ref_adv.ADV_ESTIMATORS):
        for setting in settings.get(est, [{}]):
            label = est + "".join(f" {k}={v}" for k, v in setting.items())
            yield label, est, setting


def _adapter_adv(env: StageEnv, case: Case, est: str, setting: dict):
    out, _ = env.call("compute_advantages", label=f"{est} on {case.name}",
                      **_adv_kwargs(case, est, setting))
    if not (isinstance(out, (tuple, list)) and len(out) == 2):
        raise AdapterRaised("compute_advantages", TypeError(
            f"expected (advantages, returns), got {type(out).__name__}"))
    return out


@stage_check("compute_advantages", "parity", "parity")
def advantages_parity(env: StageEnv) -> CheckResult:
    """Advantages and returns equal the reference estimator's on every valid token, for every
    estimator the adapter supports (gae with gamma=0.9, lam=0.95; grpo with and without std
    normalisation; ...), on ragged batches with singleton groups, non-contiguous uids, empty
    responses, masked holes and an all-masked row."""
    t = env.tally("compute_advantages:parity")
    conv = env.conventions(t.check)
    for label, est, setting in _adv_runs(env):
        cases = list(env.cases)
        if conv.get("outcome_score") == "unmasked-sum" and est in OUTCOME_ESTIMATORS:
            # the convention reads rewards under the mask: give it some to read, so that an
            # adapter declaring it without following it fails too
            cases += [with_garbage(c, keep=tuple(f for f in FLOAT_FIELDS
                                                 if f != "token_level_rewards")) for c in cases]
        for case in cases:
            def one():
                adv, ret = _adapter_adv(env, case, est, setting)
                kw = _adv_kwargs(case, est, setting)
                kw.pop("estimator")
                want_adv, want_ret = ref_adv.compute_advantages(
                    est, **kw, **{k: v for k, v in conv.items() if k in ADV_CONVENTIONS})
                t.compare(f"{label} advantages on {case.name}", adv, want_adv, case.mask)
                t.compare(f"{label} returns on {case.name}", ret, want_ret, case.mask)
            attempt(t, label, one, skip_as=est)
    return t.result("estimator x case comparisons agree with the reference")


@stage_check("compute_advantages", "row-permutation", "metamorphic")
def advantages_permutation(env: StageEnv) -> CheckResult:
    """Permuting the rows (uids travel with their rows) permutes the advantages the same way:
    groups are found by uid, never by position."""
    t = env.tally("compute_advantages:row-permutation")
    for label, est, setting in _adv_runs(env):
        for case in env.cases:
            if len(case.mask) < 2:
                continue
            perm = fixed_permutation(len(case.mask))

            def one():
                adv, _ = _adapter_adv(env, case, est, setting)
                adv_p, _ = _adapter_adv(env, case.permuted(perm), est, setting)
                t.compare(f"{label} on {case.name} (rows permuted)", adv_p, adv.detach()[perm],
                          case.mask[perm])
            attempt(t, label, one, skip_as=est)
    return t.result("permuted runs agree")


@stage_check("compute_advantages", "masked-values", "metamorphic")
def advantages_masked(env: StageEnv) -> CheckResult:
    """Rewards and values written where ``response_mask`` is False (finite garbage) change no
    advantage or return on a valid token."""
    t = env.tally("compute_advantages:masked-values")
    # under the declared convention outcome_score=unmasked-sum, rewards under the mask are read
    # by design: garbage then goes only where the convention still ignores it
    unmasked = (env.conventions(t.check).get("outcome_score") == "unmasked-sum")
    for label, est, setting in _adv_runs(env):
        keep = ("token_level_rewards",) if unmasked and est in OUTCOME_ESTIMATORS else ()
        for case in env.cases:
            def one():
                adv, ret = _adapter_adv(env, case, est, setting)
                adv_g, ret_g = _adapter_adv(env, with_garbage(case, keep=keep), est, setting)
                t.compare(f"{label} advantages on {case.name} with garbage under the mask",
                          adv_g, adv.detach(), case.mask)
                t.compare(f"{label} returns on {case.name} with garbage under the mask",
                          ret_g, ret.detach(), case.mask)
            attempt(t, label, one, skip_as=est)
    return t.result("runs with garbage under the mask agree")


# ---- KL in reward ----------------------------------------------------------------------------

KL_COEF = 0.1


def _k3_clamp(env: StageEnv, check: str) -> str:
    """k3's value clamp the reference uses for ``check`` (the declared convention, else ours)."""
    return env.conventions(check).get("k3_clamp", DEFAULT_K3_CLAMP)


def _kl_reward_runs(env: StageEnv, check: str):
    coef = env.setting("kl_coef", KL_COEF)
    k3_clamp = _k3_clamp(env, check)
    for kind in env.names("kl_estimators", KL_ESTIMATORS):
        for case in env.cases:
            def run(kind=kind, case=case):
                extra = ({"response_lengths": case["response_lengths"]}
                         if accepts(env.adapter.apply_kl_in_reward, "response_lengths") else {})
                out, _ = env.call("apply_kl_in_reward", label=f"{kind} on {case.name}",
                                  token_level_scores=case["token_level_scores"],
                                  old_log_probs=case["old_log_probs"],
                                  ref_log_probs=case["ref_log_probs"], response_mask=case.mask,
                                  kl_coef=coef, kl_penalty=kind, **extra)
                rewards, kl = out
                want_r, want_kl = apply_kl_in_reward(
                    case["token_level_scores"], case["old_log_probs"], case["ref_log_probs"],
                    case.mask, kl_coef=coef, kl_penalty=kind, k3_clamp=k3_clamp)
                return rewards, kl, want_r, want_kl
            yield kind, case, run


@stage_check("apply_kl_in_reward", "stored-kl-unaltered", "seed")
def stored_kl_unaltered(env: StageEnv) -> CheckResult:
    """The KL the stage returns for storage (what ``rollout/kl`` later logs) is the KL estimate
    ``kl_penalty(old_log_probs, ref_log_probs)`` on every valid token, not the shaped reward
    (slime PR #2114: the reward was built in place in a tensor aliasing the stored KL)."""
    t = env.tally("apply_kl_in_reward:stored-kl-unaltered")
    for kind, case, run in _kl_reward_runs(env, t.check):
        def one():
            _, kl, _, want_kl = run()
            t.compare(f"stored kl ({kind}) on {case.name}", kl, want_kl, case.mask)
        attempt(t, kind, one)
    return t.result("stored KL tensors equal the KL estimate")


@stage_check("apply_kl_in_reward", "parity", "parity")
def kl_reward_parity(env: StageEnv) -> CheckResult:
    """``token_level_rewards = token_level_scores - kl_coef * kl`` on every valid token, for every
    KL estimator the adapter supports."""
    t = env.tally("apply_kl_in_reward:parity")
    for kind, case, run in _kl_reward_runs(env, t.check):
        def one():
            rewards, _, want_r, _ = run()
            t.compare(f"token_level_rewards ({kind}) on {case.name}", rewards, want_r, case.mask)
        attempt(t, kind, one)
    return t.result("reward tensors agree with the reference")


# ---- KL estimators ---------------------------------------------------------------------------

@stage_check("kl_penalty", "parity", "parity")
def kl_penalty_parity(env: StageEnv) -> CheckResult:
    """Every KL estimator's per-token value and its gradient with respect to ``log_prob`` equal
    the reference's on valid tokens (straight-through ``k1+``/``k3+``: value of k1/k3, gradient
    of k2)."""
    t = env.tally("kl_penalty:parity")
    k3_clamp = _k3_clamp(env, t.check)
    for kind in env.names("kl_estimators", KL_ESTIMATORS):
        for case in env.cases:
            def one(kind=kind, case=case):
                out, given = env.call("kl_penalty", label=f"{kind} on {case.name}",
                                      log_prob=case["log_probs"].clone().requires_grad_(True),
                                      ref_log_prob=case["ref_log_probs"], kind=kind)
                lp = case["log_probs"].detach().clone().requires_grad_(True)
                want = kl_penalty(lp, case["ref_log_probs"], kind, k3_clamp=k3_clamp)
                t.compare(f"{kind} on {case.name}", out, want, case.mask)
                if isinstance(out, torch.Tensor) and out.shape == case.shape:
                    t.compare(f"{kind} gradient on {case.name}",
                              _grad_of(out, given["log_prob"], case.mask),
                              _grad_of(want, lp, case.mask), case.mask)
            attempt(t, kind, one)
    return t.result("estimator x case comparisons (values and gradients) agree")


# ---- loss aggregation ------------------------------------------------------------------------

def _agg(env: StageEnv, loss_mat, mask, mode, denominators=None, label=""):
    kw = dict(loss_mat=loss_mat, mask=mask, mode=mode)
    if denominators is not None:
        kw["denominators"] = denominators
    out, given = env.call("agg_loss", label=label, **kw)
    return out, given["loss_mat"]


def _own_counts(env: StageEnv, check: str, mask: torch.Tensor, norm_len=None
                ) -> Denominators | None:
    """The counts a batch's own aggregation divides by, under the declared ``seq_count``
    convention (None: the reference's default, rows with a valid token)."""
    seq_count = env.conventions(check).get("seq_count", "valid-rows")
    if seq_count == "valid-rows" and norm_len is None:
        return None
    return Denominators.of(mask, norm_len=norm_len, seq_count=seq_count)


def _loss_input(case: Case) -> torch.Tensor:
    return (case["log_probs"] - case["old_log_probs"]) * case["advantages"]


@stage_check("agg_loss", "parity", "parity")
def agg_parity(env: StageEnv) -> CheckResult:
    """Every ``loss_agg_mode`` gives the reference's value and gradient (docs/internals.md table;
    ``seq-mean-token-sum-norm`` divides by the width R), and a batch without any valid token
    gives 0, not NaN."""
    t = env.tally("agg_loss:parity")
    for mode in env.names("loss_agg_modes", AGG_MODES):
        for case in env.cases:
            def one(mode=mode, case=case):
                lm = _loss_input(case).requires_grad_(True)
                out, leaf = _agg(env, lm, case.mask, mode, label=f"{mode} on {case.name}")
                ref_leaf = lm.detach().clone().requires_grad_(True)
                want = agg_loss(ref_leaf, case.mask, mode, _own_counts(env, t.check, case.mask))
                t.compare(f"{mode} on {case.name}", out, want.detach())
                t.compare(f"{mode} gradient on {case.name}", _grad_of(out, leaf),
                          _grad_of(want, ref_leaf), case.mask)
                empty = ~case.mask.any(-1)
                if bool(empty.any()):
                    rows = empty.nonzero().flatten()
                    e_out, _ = _agg(env, lm.detach()[rows], case.mask[rows], mode,
                                    label=f"{mode} on rows without a valid token")
                    t.compare(f"{mode} on rows of {case.name} without a valid token", e_out,
                              torch.zeros((), dtype=torch.float64))
            attempt(t, mode, one)
    return t.result("mode x case comparisons agree")


def trimmed_width(mask: torch.Tensor) -> int:
    """The width of ``mask``'s rows cut after the last column holding a valid token (1 when
    none does): a micro-batch padded to its own longest response."""
    cols = mask.any(0).nonzero()
    return int(cols[-1]) + 1 if len(cols) else 1


@stage_check("agg_loss", "global-split", "metamorphic")
def agg_global_split(env: StageEnv) -> CheckResult:
    """With the whole batch's ``Denominators`` passed to every micro-batch, the micro-batch
    results (and gradients) sum to the adapter's own whole-batch value: the loss is normalised
    globally, never per micro-batch (a token-mean per micro-batch then averaged weighs short
    micro-batches up). n/a when ``agg_loss`` takes no ``denominators``."""
    t = env.tally("agg_loss:global-split")
    if not accepts(env.adapter.agg_loss, "denominators"):
        return CheckResult(t.check, env.name, NA, "agg_loss takes no `denominators` argument")
    for mode in env.names("loss_agg_modes", AGG_MODES):
        for case in env.cases:
            def one(mode=mode, case=case):
                lm = _loss_input(case)
                denom = _own_counts(env, t.check, case.mask, norm_len=case.shape[1])
                leaf = lm.clone().requires_grad_(True)
                whole, whole_leaf = _agg(env, leaf, case.mask, mode, label=f"{mode} whole batch")
                whole_grad = _grad_of(whole, whole_leaf)
                parts, grads = [], torch.zeros_like(lm)
                for rows in split_rows(len(lm)):
                    # each micro-batch padded to its own longest response, as trainers that
                    # pad per micro-batch do: the whole batch's width R reaches it only as
                    # denominators.norm_len (seq-mean-token-sum-norm divides by it)
                    w = trimmed_width(case.mask[rows])
                    leaf = lm[rows][:, :w].requires_grad_(True)
                    out, given_leaf = _agg(env, leaf, case.mask[rows][:, :w], mode, denom,
                                           label=f"{mode} rows {rows.tolist()} (width {w})")
                    parts.append(out.detach() if isinstance(out, torch.Tensor) else out)
                    grads[rows, :w] = _grad_of(out, given_leaf)
                total = sum(float(p) for p in parts)
                t.compare(f"{mode} on {case.name}: sum over {len(parts)} micro-batches", total,
                          whole.detach())
                t.compare(f"{mode} gradient on {case.name}: sum over micro-batches", grads,
                          whole_grad, case.mask)
            attempt(t, mode, one)
    return t.result("split sums agree with the whole-batch value")


# ---- running -------------------------------------------------------------------------------

def _no_mutation_check(stage: str) -> None:
    @stage_check(stage, "no-mutation", "no-mutation")
    def check(env: StageEnv) -> CheckResult:
        name = f"{stage}:no-mutation"
        calls = env.guard.calls.get(stage, 0)
        if not calls:
            return CheckResult(name, env.name, NA, f"{stage} was not called by any check")
        problems = list(dict.fromkeys(env.guard.problems.get(stage, [])))
        if problems:
            more = len(problems) - MAX_QUOTED
            return CheckResult(name, env.name, FAIL, "; ".join(problems[:MAX_QUOTED]) +
                               (f" (+{more} more)" if more > 0 else ""), {"problems": problems})
        notes = list(dict.fromkeys(env.guard.notes.get(stage, [])))
        note = (f" (note: {'; '.join(notes[:2])}: harmless unless one is later written in "
                f"place)") if notes else ""
        return CheckResult(name, env.name, PASS, f"{calls} calls: inputs unchanged (values and "
                           f"version counters), no output aliases an input{note}",
                           {"notes": notes} if notes else {})
    check.__doc__ = (f"Across every call the other checks made, ``{stage}`` never modified an "
                     f"input in place (values and ``tensor._version``) and returned no output "
                     f"sharing storage with an input (outputs sharing storage with each other "
                     f"are noted).")


for _stage in STAGES:
    if _stage != "train_step":      # train_step has its own no-input-mutation check
        _no_mutation_check(_stage)


def run_stage_checks(adapter: object, *, stages: list[str] | None = None,
                     model_path: str | None = None) -> ScenarioResult:
    """Every registered check, on the stages the adapter provides (``stages`` restricts them),
    as the pseudo-scenario ``"stages"`` with the adapter as its only backend."""
    t0 = time.perf_counter()
    env = StageEnv(adapter, model_path=model_path)
    name = env.name
    res = ScenarioResult(scenario="stages", path="<stage checks>", backends=[name],
                         tags=["stages"])
    ordered = sorted(stage_checks().values(),
                     key=lambda c: (list(STAGES).index(c.stage), c.name.endswith("no-mutation")))
    for check in ordered:
        if stages is not None and check.stage not in stages:
            continue
        if not has_stage(adapter, check.stage):
            res.checks.append(CheckResult(check.name, name, NA,
                                          f"{name} does not provide {check.stage}"))
            continue
        try:
            res.checks.append(check.fn(env))
        except InputError:      # the adapter's declarations are wrong (exit 2), not a finding
            raise
        except (Exception, SystemExit) as e:  # a bug in the check, or the adapter outside attempt()
            res.checks.append(CheckResult(check.name, name, ERROR,
                                          f"the check raised {type(e).__name__}: {e}",
                                          {"traceback": traceback.format_exc()}))
    res.seconds = time.perf_counter() - t0
    return res
