"""Stage checks that need no reference value: identities and metamorphic relations an adapter's
stage satisfies on its own (registered into checks.STAGE_CHECKS).

They are the second, independent way each bug class of the parity/no-mutation checks can fail
(docs/targets.md, "The checks"):

- ``apply_kl_in_reward:rewards-from-stored-kl``: the returned rewards equal the scores minus
  ``kl_coef`` times the *returned* KL (read after the call): a reward built in place in the
  stored KL tensor breaks it whatever the KL formula.
- ``compute_advantages:identities``: finite advantages; outcome estimators constant along a row;
  GRPO/Dr.GRPO/RLOO advantages summing to 0 over a group.
- ``policy_loss:clip-effect``: moving ``clip_ratio_high``, ``clip_ratio_low`` or ``clip_ratio_c``
  moves the loss exactly where tokens fall in the region that bound governs, in the direction
  PPO's clipped surrogate says (a clip flag that is ignored leaves the loss unchanged).
- ``make_microbatches:loss-sums-to-batch``: a loss over every micro-batch of every rank, divided
  by the whole batch's denominators, sums to the whole-batch loss; padding micro-batches add 0
  and carry what the loss reads (SkyRL PR #1811's failure was that loss raising).
"""

from __future__ import annotations

from typing import Mapping

import torch

from rlaudit.algo import advantages as ref_adv
from rlaudit.algo.agg import AGG_MODES, Denominators, agg_loss
from rlaudit.algo.policy_loss import POLICY_LOSSES
from rlaudit.data.batch import Kind
from rlaudit.targets.contract.adapter import supported_names
from rlaudit.targets.inputs.cases import Case
from rlaudit.targets.stages.advantage import KL_COEF, adapter_adv, adv_runs, kl_reward_runs
from rlaudit.targets.stages.batch import layouts
from rlaudit.targets.stages.loss import adapter_policy, oracle_policy
from rlaudit.targets.stages.registry import StageEnv, attempt, stage_check
from rlaudit.verdict.result import CheckResult
from rlaudit.verdict.tolerance import Tolerance

#: estimators whose advantage is one value per row (broadcast over its valid tokens)
ROW_CONSTANT = ("grpo", "drgrpo", "rloo", "reinforce_plus_plus_baseline")
#: estimators whose row advantages sum to 0 over a group of two or more rows
GROUP_ZERO_SUM = ("grpo", "drgrpo", "rloo")
# (batch whitening of gae / reinforce_plus_plus is verl's convention, not an identity: SkyRL's
# GAE is not whitened, so a mean-0 check would be a false alarm there)


# ---- advantages ------------------------------------------------------------------------------

def _canonical(est: str) -> str:
    return ref_adv.ADV_ESTIMATORS.canonical(est)


@stage_check("compute_advantages", "identities", "identity")
def advantages_identities(env: StageEnv) -> CheckResult:
    """On every valid token the advantages are finite; the outcome estimators (grpo, drgrpo,
    rloo, reinforce_plus_plus_baseline) give one value per row; grpo, drgrpo and rloo advantages
    sum to 0 over every group of two or more rows whose rows all have a valid token (scores
    centred on the group mean). No reference implementation is involved: a
    NaN, a group found by position or a missing centring fails here as well as in parity."""
    t = env.tally("compute_advantages:identities")
    for label, est, setting in adv_runs(env):
        name = _canonical(est)
        for case in env.cases:
            def one(case=case, est=est, name=name, setting=setting, label=label):
                adv, _ = adapter_adv(env, case, est, setting)
                adv = torch.as_tensor(adv).detach().double()
                mask = case.mask
                t.checked += 1
                bad = mask & ~torch.isfinite(adv)
                if bool(bad.any()):
                    i, j = [int(x) for x in bad.nonzero()[0]]
                    t.fail(f"{label} on {case.name}: advantage [{i}, {j}] = {float(adv[i, j])}")
                    return
                if name in ROW_CONSTANT:
                    for i in range(mask.shape[0]):
                        vals = adv[i][mask[i]]
                        if vals.numel() > 1:
                            t.compare(f"{label} on {case.name}: row {i} is one value", vals,
                                      vals[:1].expand_as(vals))
                if name in GROUP_ZERO_SUM:
                    rows_of: dict[int, list[int]] = {}
                    for i, u in enumerate(case["uid"].tolist()):
                        rows_of.setdefault(u, []).append(i)
                    for u, rows in rows_of.items():
                        if len(rows) < 2 or not all(bool(mask[i].any()) for i in rows):
                            continue
                        row_adv = [float(adv[i][mask[i]][0]) for i in rows]
                        # rounding of a sum grows with its terms, not with its value (0)
                        size = max(1.0, sum(abs(a) for a in row_adv))
                        t.compare(f"{label} on {case.name}: group {u} sums to 0",
                                  sum(row_adv), 0.0,
                                  tol=Tolerance(t.tol.rtol, t.tol.atol * size))
            attempt(t, label, one, skip_as=est)
    return t.result("identities hold")


# ---- KL in reward: the stored KL is the one the reward subtracted -----------------------------

@stage_check("apply_kl_in_reward", "rewards-from-stored-kl", "identity")
def rewards_from_stored_kl(env: StageEnv) -> CheckResult:
    """On every valid token, ``token_level_rewards = token_level_scores - kl_coef * kl`` with
    ``kl`` the tensor the stage returned for storage, both read after the call. Independent of
    the KL formula: when the reward is built in place in the stored tensor (slime PR #2114),
    ``kl`` *is* the reward and the identity fails."""
    t = env.tally("apply_kl_in_reward:rewards-from-stored-kl")
    for kind, case, run in kl_reward_runs(env, t.check):
        def one(kind=kind, case=case, run=run):
            rewards, kl, _, _ = run()
            coef = env.setting("kl_coef", KL_COEF)      # the coefficient the stage was given
            want = case["token_level_scores"].double() - coef * torch.as_tensor(kl).double()
            t.compare(f"rewards vs scores - kl_coef * stored kl ({kind}) on {case.name}",
                      rewards, want, case.mask)
        attempt(t, kind, one)
    return t.result("rewards consistent with the stored KL")


# ---- policy loss: clip settings act where they should ------------------------------------------

#: (knob, base clip, moved clip, +1: loss must rise / -1: fall when governed tokens exist)
CLIP_MOVES = (("clip_ratio_high", (0.2, 0.2, 3.0), (0.2, 0.28, 3.0), -1),
              ("clip_ratio_low", (0.1, 0.28, 3.0), (0.2, 0.28, 3.0), -1),
              ("clip_ratio_c", (0.2, 0.28, 3.0), (0.2, 0.28, 5.0), +1))


def _governed(case: Case, knob: str, base, moved) -> int:
    """Valid tokens whose per-token vanilla-PPO loss changes when ``knob`` moves from ``base`` to
    ``moved``: A > 0 with ratio above 1 + high (the clipped value -A(1+high) is taken); A < 0
    with ratio below 1 - low (-A(1-low) is taken; smaller with a larger low); A < 0 with
    ratio above the dual-clip bound c (-A c is taken)."""
    m = case.mask
    a = case["advantages"]
    r = torch.exp(case["log_probs"] - case["old_log_probs"])
    if knob == "clip_ratio_high":
        region = (a > 0) & (r > 1 + base[1])
    elif knob == "clip_ratio_low":
        region = (a < 0) & (r < 1 - base[0])
    else:
        region = (a < 0) & (r > base[2])
    return int((region & m).sum())


@stage_check("policy_loss", "clip-effect", "config-effect")
def policy_clip_effect(env: StageEnv) -> CheckResult:
    """For loss mode ``vanilla``: raising ``clip_ratio_high`` (0.2 -> 0.28) lowers the loss when
    some valid token has A > 0 and ratio > 1.2, raising ``clip_ratio_low`` (0.1 -> 0.2) lowers it
    when some has A < 0 and ratio < 0.9, raising the dual-clip bound ``clip_ratio_c`` (3 -> 5)
    raises it when some has A < 0 and ratio > 3; with no such token the loss is unchanged. A
    relation of PPO's clipped surrogate alone (every aggregation weighs tokens positively): an
    ignored or swapped clip setting fails here whatever the reference computes."""
    t = env.tally("policy_loss:clip-effect")
    if "vanilla" not in supported_names(env.adapter, "loss_modes", POLICY_LOSSES):
        t.skip("vanilla", "not supported")
        return t.result("")
    aggs = supported_names(env.adapter, "loss_agg_modes", AGG_MODES, key="vanilla")
    agg = "token-mean" if "token-mean" in aggs else aggs[0]
    for knob, base, moved, sign in CLIP_MOVES:
        for case in env.cases:
            def one(case=case, knob=knob, base=base, moved=moved, sign=sign):
                lo, _, _ = adapter_policy(env, case, "vanilla", agg, base,
                                           label=f"{knob}={base} on {case.name}")
                hi, _, _ = adapter_policy(env, case, "vanilla", agg, moved,
                                           label=f"{knob}={moved} on {case.name}")
                lo, hi = float(torch.as_tensor(lo).detach()), float(torch.as_tensor(hi).detach())
                n = _governed(case, knob, base, moved)
                what = f"{knob} {base} -> {moved} on {case.name} ({agg})"
                if n == 0:
                    t.compare(f"{what}: no token governed, loss unchanged", hi, lo)
                    return
                tol = t.tol.atol * max(1.0, abs(lo)) + t.tol.rtol * abs(lo)
                conv = env.conventions(t.check)
                want = float(oracle_policy(case, "vanilla", agg, moved, conventions=conv)[0]
                             - oracle_policy(case, "vanilla", agg, base, conventions=conv)[0])
                if not abs(want) > 2 * tol:   # the declared precision cannot show the move
                    t.skip(what, f"the reference moves the loss by {want:.3g}, within twice "
                                 f"the tolerance {tol:.3g}: not resolvable at this precision")
                    return
                t.checked += 1
                if not sign * (hi - lo) > tol:
                    t.fail(f"{what}: {n} governed token(s), so the loss must "
                           f"{'rise' if sign > 0 else 'fall'}; got {lo:.8g} -> {hi:.8g}")
            attempt(t, knob, one, skip_as="vanilla")
    return t.result("clip moves act where PPO says")


# ---- micro-batches: a loss over them sums to the whole batch's ----------------------------------

#: per-token coefficient of each float field in the synthetic loss (fields the cutter keeps)
LOSS_FIELDS = {"old_log_probs": 1.0, "advantages": -0.5, "rollout_log_probs": 0.25,
               "loss_weights": 2.0}


def _loss_mat(mb: Mapping[str, torch.Tensor], fields: list[str]) -> torch.Tensor:
    total = None
    for f in fields:
        part = LOSS_FIELDS[f] * mb[f].double()
        total = part if total is None else total + part
    return total


@stage_check("make_microbatches", "loss-sums-to-batch", "metamorphic")
def loss_sums_to_batch(env: StageEnv) -> CheckResult:
    """For every layout and aggregation mode, a loss over the per-token float fields the
    trainer's real micro-batches carry, aggregated on each micro-batch of each rank with the
    whole batch's denominators, sums to the same loss of the whole batch: rows neither dropped
    nor duplicated nor re-masked, padding micro-batches adding 0 — and carrying every field the
    loss reads (a padding micro-batch built from a hard-coded key list made SkyRL's loss raise
    inside the distributed backward, PR #1811)."""
    modes = list(AGG_MODES)

    def body(t, batch, label, layout, ranks):
        real = [mb for micros in ranks for mb in micros
                if bool(mb.get("response_mask", torch.zeros(1)).bool().any())]
        if not real:
            if bool(batch.mask.any()):      # a batch without valid tokens has no loss to sum
                t.fail(f"{label}: no micro-batch holds a valid token")
            return
        fields = [f for f in LOSS_FIELDS if f in batch.tensors
                  and batch.kinds[f] == Kind.TOKEN and f in real[0]]
        if not fields:
            return
        denom = Denominators.of(batch.mask, norm_len=batch.response_width)
        whole_mat = _loss_mat(batch.tensors, fields)
        for mode in modes:
            t.checked += 1
            total = 0.0
            for r, micros in enumerate(ranks):
                for j, mb in enumerate(micros):
                    lacking = [f for f in fields + ["response_mask"] if f not in mb]
                    if lacking:
                        kind = "padding " if not mb.get("response_mask", torch.ones(1)).any() \
                            else ""
                        t.fail(f"{label}: the loss reads {lacking}, absent from rank {r} "
                               f"{kind}micro-batch {j} (it would raise there)")
                        return
                    mask = mb["response_mask"].bool()
                    total += float(agg_loss(_loss_mat(mb, fields), mask, mode, denom))
            want = float(agg_loss(whole_mat, batch.mask, mode, denom))
            t.compare(f"{label}: {mode} loss summed over micro-batches vs the whole batch",
                      total, want)
    return layouts(env, "make_microbatches:loss-sums-to-batch", body).result(
        "layouts x modes: micro-batch losses sum to the batch loss")

