"""Stage checks of the advantage and KL stages: ``compute_advantages``, ``apply_kl_in_reward``
and ``kl_penalty`` against rlaudit.algo, with their metamorphic relations (row permutation,
values under the mask). Per-token tensors are ``[B, R]``; comparisons are on valid tokens
(``response_mask`` True).
"""

from __future__ import annotations

import torch

from rlaudit.algo import advantages as ref_adv
from rlaudit.algo.kl import DEFAULT_K3_CLAMP, KL_ESTIMATORS, kl_penalty
from rlaudit.algo.reward import apply_kl_in_reward
from rlaudit.targets.contract.adapter import accepts
from rlaudit.targets.contract.guard import AdapterRaised
from rlaudit.targets.inputs.cases import (FLOAT_FIELDS, Case, fixed_permutation, kl_clamp_case,
                                          with_garbage)
from rlaudit.targets.stages.common import grad_of
from rlaudit.targets.stages.registry import StageEnv, attempt, stage_check
from rlaudit.verdict.result import CheckResult


# ---- advantages ------------------------------------------------------------------------------

#: estimator -> keyword settings exercised (gamma/lam below 1 so discounting shows)
#: conventions compute_advantages takes (rlaudit.targets.contract.declare.CONVENTIONS)
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


def adv_runs(env: StageEnv):
    """(label, estimator, setting) for every supported estimator and its settings."""
    settings = env.setting("estimator_settings", ESTIMATOR_SETTINGS)
    for est in env.names("advantage_estimators", ref_adv.ADV_ESTIMATORS):
        for setting in settings.get(est, [{}]):
            label = est + "".join(f" {k}={v}" for k, v in setting.items())
            yield label, est, setting


def adapter_adv(env: StageEnv, case: Case, est: str, setting: dict):
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
    for label, est, setting in adv_runs(env):
        cases = list(env.cases)
        if conv.get("outcome_score") == "unmasked-sum" and est in OUTCOME_ESTIMATORS:
            # the convention reads rewards under the mask: give it some to read, so that an
            # adapter declaring it without following it fails too
            cases += [with_garbage(c, keep=tuple(f for f in FLOAT_FIELDS
                                                 if f != "token_level_rewards")) for c in cases]
        for case in cases:
            def one():
                adv, ret = adapter_adv(env, case, est, setting)
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
    for label, est, setting in adv_runs(env):
        for case in env.cases:
            if len(case.mask) < 2:
                continue
            perm = fixed_permutation(len(case.mask))

            def one():
                adv, _ = adapter_adv(env, case, est, setting)
                adv_p, _ = adapter_adv(env, case.permuted(perm), est, setting)
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
    for label, est, setting in adv_runs(env):
        keep = ("token_level_rewards",) if unmasked and est in OUTCOME_ESTIMATORS else ()
        for case in env.cases:
            def one():
                adv, ret = adapter_adv(env, case, est, setting)
                adv_g, ret_g = adapter_adv(env, with_garbage(case, keep=keep), est, setting)
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


def kl_reward_runs(env: StageEnv, check: str):
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
    for kind, case, run in kl_reward_runs(env, t.check):
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
    for kind, case, run in kl_reward_runs(env, t.check):
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
    of k2), on the fixed cases and on one past k3's value clamp (``kl_clamp_case``)."""
    t = env.tally("kl_penalty:parity")
    k3_clamp = _k3_clamp(env, t.check)
    for kind in env.names("kl_estimators", KL_ESTIMATORS):
        for case in [*env.cases, kl_clamp_case()]:    # the KL clamps act on the last case only
            def one(kind=kind, case=case):
                out, given = env.call("kl_penalty", label=f"{kind} on {case.name}",
                                      log_prob=case["log_probs"].clone().requires_grad_(True),
                                      ref_log_prob=case["ref_log_probs"], kind=kind)
                lp = case["log_probs"].detach().clone().requires_grad_(True)
                want = kl_penalty(lp, case["ref_log_probs"], kind, k3_clamp=k3_clamp)
                t.compare(f"{kind} on {case.name}", out, want, case.mask)
                if isinstance(out, torch.Tensor) and out.shape == case.shape:
                    t.compare(f"{kind} gradient on {case.name}",
                              grad_of(out, given["log_prob"], case.mask),
                              grad_of(want, lp, case.mask), case.mask)
            attempt(t, kind, one)
    return t.result("estimator x case comparisons (values and gradients) agree")
