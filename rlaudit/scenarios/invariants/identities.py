"""Identities (family 4), config effect (family 5) and the grad-norm identity (family 8).

All of them look at step 0 of a variant that makes the step one on-policy optimizer step over the
whole batch (ppo_epochs = 1, one mini-batch): there the new policy equals the old one, so
ratio = 1, clip fraction 0, ppo_kl 0, KL to an identical reference 0, and the policy-gradient
loss has a closed form in the advantages that is recomputed here by a naive loop.
"""

from __future__ import annotations

import torch

from rlaudit.scenarios.invariants.base import (CheckContext, base_variant, invariant,
                                               not_applicable, result)
from rlaudit.scenarios.invariants.logged import logged_agg, microbatch_rows
from rlaudit.scenarios.invariants.naive import naive_kl
from rlaudit.scenarios.invariants.seeds import one_minibatch

AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def expected_pg_loss(run, batch, cfg) -> float | None:
    """Closed-form on-policy pg_loss: agg(-A * w) for vanilla/gspo (ratio 1), agg(-A * w * logp)
    for cispo (whose surrogate is -clip(ratio).detach() * A * log_prob), reduced over
    micro-batches as the backend logs it (:func:`~rlaudit.scenarios.invariants.logged.logged_agg`;
    None: a micro-batch mean whose micro-batches' rows are unknown)."""
    t = run.tokens
    per_token = -t["advantages"].double()
    if cfg.actor.rollout_correction.rollout_is is not None:
        per_token = per_token * t["rollout_is_weights"].double()
    if cfg.actor.loss_mode == "cispo":
        per_token = per_token * t["probe_log_probs"].double()
    return logged_agg("actor/pg_loss", per_token, batch.mask, cfg,
                      microbatch_rows(run, cfg, batch))


def _cfg(ctx, name):
    for v in ctx.variants:
        if v.name == name:
            return v.config
    raise KeyError(name)


# ---- on-policy identities --------------------------------------------------------------------

def _onpolicy_variants(scn, batch):
    return [base_variant(scn, batch, "onpolicy", **one_minibatch(scn, batch))]


@invariant("on-policy-identities", "identity", variants=_onpolicy_variants)
def on_policy_identities(ctx: CheckContext):
    """On one on-policy optimizer step: ``pg_clipfrac = pg_clipfrac_lower = 0``, ``ppo_kl = 0``,
    ``pg_loss`` equals its closed form (agg of -A, times the rollout IS weights when enabled; with
    log-prob for CISPO) under the configured ``loss_agg_mode``, ``actor/entropy`` (when logged)
    equals the initial policy's entropy aggregated the same way, and ``actor/kl_loss`` is 0 when
    the reference policy is the initial actor. A metric the backend reduces as a micro-batch
    mean (``trainer.metric_reduction``) is recomputed as the mean over its micro-batches of each
    one's aggregate."""
    out = []
    scn = ctx.scenario
    cfg = _cfg(ctx, "onpolicy")
    mask = ctx.mask("onpolicy")
    for b in ctx.backends():
        runs, na = ctx.need("on-policy-identities", b, "onpolicy")
        if na:
            out.append(na)
            continue
        run = runs[0]
        m = run.steps[0]
        problems = []

        unlogged = []

        unknown = []

        def near(name, want, what):
            got = m.get(name)
            if got is None:     # a name a backend never logs is compared by backend-parity
                unlogged.append(name)
            elif want is None:  # a micro-batch mean over micro-batches whose rows are unknown
                unknown.append(name)
            elif not scn.tol(name).close(got, want):
                problems.append(f"{name} = {got:.10g}, {what} {want:.10g}")

        for name in ("actor/pg_clipfrac", "actor/pg_clipfrac_lower"):
            if m.get(name, 0.0) != 0.0:
                problems.append(f"{name} = {m[name]:.6g} on an on-policy step (ratio is 1)")
        near("actor/ppo_kl", 0.0, "on-policy value")
        want_pg = expected_pg_loss(run, ctx.batch_of("onpolicy"), cfg)
        near("actor/pg_loss", want_pg, "closed form")
        if cfg.compute_entropy:
            near("actor/entropy", logged_agg("actor/entropy", run.tokens["probe_entropy"], mask,
                                             cfg, microbatch_rows(run, cfg,
                                                                  ctx.batch_of("onpolicy"))),
                 "recomputed")
        if cfg.actor.use_kl_loss and scn.ref_model is None:
            near("actor/kl_loss", 0.0, "policy = reference, expected")
        drift = (abs(m.get("actor/pg_loss", 0.0) - want_pg) / max(abs(want_pg), 1e-12)
                 if want_pg is not None else 0.0)
        if "actor/pg_loss" in unlogged:
            problems.append("actor/pg_loss not logged")
        if "actor/pg_loss" in unknown and not problems:
            out.append(not_applicable("on-policy-identities", b, "actor/pg_loss is reduced as a "
                                      "micro-batch mean and the micro-batches' rows are unknown "
                                      "(micro-batch records do not fit the batch)"))
            continue
        skipped = f" (not logged, not checked: {', '.join(unlogged)})" if unlogged else ""
        if unknown:
            skipped += (f" (micro-batch means over micro-batches of unknown rows, not checked: "
                        f"{', '.join(unknown)})")
        out.append(result("on-policy-identities", b, not problems, "; ".join(problems) or
                          f"ratio-1 identities hold (pg_loss = {want_pg:.6g}){skipped}",
                          drift=drift))
    return out


# ---- config effect ---------------------------------------------------------------------------

#: the aggregation of the entropy pair (cfg:entropy0 / cfg:entropy) when the scenario's own is
#: token-mean: under token-mean a trainer that adds its entropy bonus as a token mean whatever
#: ``loss_agg_mode`` says is right, so the pair would never show it (a trainer with that
#: ignored-aggregation bug passes every token-mean scenario; scenarios with an entropy bonus
#: under token-mean, rollout_temperature and megatron_padded_vocab, catch the opposite fixed
#: choice)
ENTROPY_PAIR_AGG = "seq-mean-token-mean"
#: cfg:agg:seq-mean-token-sum-norm's loss_scale_factor, in padded widths (when the scenario sets
#: none)
SUM_NORM_HORIZON = 2


def _config_variants(scn, batch):
    o = one_minibatch(scn, batch)
    agg = scn.config.actor.loss_agg_mode
    ent = {"actor.calculate_entropy": True,
           "actor.loss_agg_mode": ENTROPY_PAIR_AGG if agg == "token-mean" else agg}
    vs = [base_variant(scn, batch, "cfg:entropy0", **o, **ent, **{"actor.entropy_coeff": 0.0}),
          base_variant(scn, batch, "cfg:entropy", **o, **ent, **{"actor.entropy_coeff": 0.01}),
          base_variant(scn, batch, "cfg:kl0", **o, **{"actor.use_kl_loss": True,
                                                      "actor.kl_loss_coef": 0.0}),
          base_variant(scn, batch, "cfg:kl", **o, **{"actor.use_kl_loss": True,
                                                     "actor.kl_loss_coef": 0.5})]
    for mode in AGG_MODES:
        extra = {}
        if mode == "seq-mean-token-sum-norm" and scn.config.actor.loss_scale_factor is None:
            # a horizon of its own, not the padded width it defaults to: a trainer that ignores
            # loss_scale_factor is right at the default (an ignored-setting bug hides there)
            extra["actor.loss_scale_factor"] = float(SUM_NORM_HORIZON * batch.response_width)
        vs.append(base_variant(scn, batch, f"cfg:agg:{mode}", **o, **extra,
                               **{"actor.loss_agg_mode": mode, "actor.loss_mode": "vanilla"}))
    return vs


@invariant("config-effect", "config-effect", variants=_config_variants)
def config_effect(ctx: CheckContext):
    """Every knob changes the result exactly as the reference semantics say (on one on-policy
    step): ``entropy_coeff = c`` lowers ``actor/loss`` by ``c * actor/entropy`` relative to
    ``c = 0`` (under a sequence-mean aggregation: :data:`ENTROPY_PAIR_AGG`); ``kl_loss_coef =
    c`` raises it by ``c * actor/kl_loss``; each ``loss_agg_mode`` gives ``pg_loss = agg(-A)``
    under that mode (seq-mean-token-sum-norm with a horizon of its own: SUM_NORM_HORIZON). (A
    term logged as a micro-batch mean while the loss is logged as a contribution enters the loss
    as its whole-batch aggregate, recomputed from the initial policy's per-token entropy / KL.)
    Run on every backend, these variants are also compared across backends by backend-parity,
    so a flag one backend ignores shows up twice."""
    out = []
    scn = ctx.scenario
    names = ["cfg:entropy0", "cfg:entropy", "cfg:kl0", "cfg:kl"] + [f"cfg:agg:{m}" for m in AGG_MODES]
    for b in ctx.backends():
        problems = []
        runs, na = ctx.need("config-effect", b, *names)
        if na:
            out.append(na)
            continue
        unchecked = []
        e0, e = runs[0].steps[0], runs[1].steps[0]
        if "actor/entropy" not in e:
            problems.append("entropy_coeff = 0.01: actor/entropy not logged")
        else:
            term = _term_in_loss(runs[1], "actor/entropy", ctx, "cfg:entropy",
                                 lambda t, c: t["probe_entropy"])
            if term is None:
                unchecked.append("entropy_coeff")
            elif not scn.tol("actor/loss").close(e["actor/loss"], e0["actor/loss"] - 0.01 * term):
                problems.append(f"entropy_coeff = 0.01: actor/loss = {e['actor/loss']:.10g}, "
                                f"expected loss(coeff 0) - 0.01 * entropy = "
                                f"{e0['actor/loss'] - 0.01 * term:.10g}")
        k0, k = runs[2].steps[0], runs[3].steps[0]
        if "actor/kl_loss" not in k:
            problems.append("use_kl_loss: actor/kl_loss not logged")
        else:
            term = _term_in_loss(runs[3], "actor/kl_loss", ctx, "cfg:kl", lambda t, c: naive_kl(
                t["probe_log_probs"], t["ref_log_probs"], c.actor.kl_loss_type,
                k3_clamp=c.algorithm.k3_clamp))
            if term is None:
                unchecked.append("kl_loss_coef")
            elif not scn.tol("actor/loss").close(k["actor/loss"], k0["actor/loss"] + 0.5 * term):
                problems.append(f"kl_loss_coef = 0.5: actor/loss = {k['actor/loss']:.10g}, "
                                f"expected loss(coef 0) + 0.5 * kl_loss = "
                                f"{k0['actor/loss'] + 0.5 * term:.10g}")
        for mode in AGG_MODES:
            run = ctx.run(b, f"cfg:agg:{mode}")
            want = expected_pg_loss(run, ctx.batch_of(f"cfg:agg:{mode}"),
                                    _cfg(ctx, f"cfg:agg:{mode}"))
            got = run.steps[0]["actor/pg_loss"]
            if want is None:
                unchecked.append(f"loss_agg_mode {mode}")
            elif not scn.tol("actor/pg_loss").close(got, want):
                problems.append(f"loss_agg_mode {mode}: pg_loss = {got:.10g}, expected "
                                f"agg(-A) = {want:.10g}")
        note = (f" (not checked: {', '.join(unchecked)}: a term logged as a micro-batch mean "
                f"whose whole-batch value cannot be recomputed)" if unchecked else "")
        out.append(result("config-effect", b, not problems, "; ".join(problems) or
                          "entropy_coeff, kl_loss_coef and every loss_agg_mode act as specified"
                          + note))
    return out


def _term_in_loss(run, name, ctx, variant, per_token) -> float | None:
    """The value of loss term ``name`` as it enters ``actor/loss``: the logged ``name`` when
    both are reduced alike over micro-batches (a sum of contributions, or a mean of local values,
    is linear in the terms), else ``per_token(run.tokens, cfg)`` (the initial policy's values:
    one on-policy step) aggregated as ``actor/loss`` is reduced (None: tensors not returned, or
    an estimator without a naive loop)."""
    cfg = _cfg(ctx, variant)
    if cfg.trainer.metric_mode(name) == cfg.trainer.metric_mode("actor/loss"):
        return run.steps[0][name]
    try:
        values = per_token(run.tokens, cfg)
    except KeyError:
        return None
    if values is None:      # an estimator the naive loops do not cover
        return None
    batch = ctx.batch_of(variant)
    return logged_agg("actor/loss", values, batch.mask, cfg, microbatch_rows(run, cfg, batch))


# ---- grad norm identity ----------------------------------------------------------------------

SGD_LR = 1e-2
#: clip far below any real gradient norm so clipping is always active, with a large learning rate
#: so the clipped step (CLIP_LR * TINY_CLIP) stays well above float32 parameter resolution
TINY_CLIP = 1e-3
CLIP_LR = 10.0


def _gradnorm_variants(scn, batch):
    o = one_minibatch(scn, batch)
    sgd = {"actor.optim.name": "sgd", "actor.optim.weight_decay": 0.0}
    return [base_variant(scn, batch, "gradnorm:noclip", **o, **sgd,
                         **{"actor.grad_clip": 0.0, "actor.optim.lr": SGD_LR}),
            base_variant(scn, batch, "gradnorm:clip", **o, **sgd,
                         **{"actor.grad_clip": TINY_CLIP, "actor.optim.lr": CLIP_LR})]


#: why the parameter-delta identities cannot judge a model whose weights are 16-bit floats
_HALF_WHY = ("parameters held in a 16-bit float: an SGD step of lr * g is rounded to ~2^-8 of "
             "each weight, so ||delta theta|| / lr does not measure the gradient (a mixed-"
             "precision trainer that keeps float32 master weights can return those instead)")


def _half_params(run) -> bool:
    return run.info.get("param_dtype") in ("torch.bfloat16", "torch.float16")


@invariant("grad-norm-identity", "sanity", variants=_gradnorm_variants)
def grad_norm_identity(ctx: CheckContext):
    """The logged ``actor/grad_norm`` is the true pre-clip global gradient norm, and clipping is
    applied: with plain SGD (no momentum, no weight decay) one step moves the parameters by
    ``-lr * g``, so ``||delta theta|| / lr`` is an independent measurement of the norm of the
    gradient actually applied. Without clipping it must equal the logged norm; with a tiny
    ``grad_clip`` it must equal ``grad_clip`` while the logged norm stays the pre-clip value."""
    out = []
    scn = ctx.scenario
    tol = scn.tol("actor/grad_norm")
    for b in ctx.backends():
        runs, na = ctx.need("grad-norm-identity", b, "gradnorm:noclip", "gradnorm:clip")
        if na:
            out.append(na)
            continue
        noclip, clip = runs
        if noclip.params_initial is None or not noclip.params:
            out.append(not_applicable("grad-norm-identity", b, "parameters not recorded "
                                      "(model too large)"))
            continue
        if _half_params(noclip):
            out.append(not_applicable("grad-norm-identity", b, _HALF_WHY))
            continue
        problems = []
        applied = float((noclip.params[0] - noclip.params_initial).norm()) / SGD_LR
        logged = noclip.steps[0]["actor/grad_norm"]
        if not tol.close(logged, applied):
            problems.append(f"no clipping: logged grad_norm {logged:.10g} but the SGD step applied "
                            f"a gradient of norm {applied:.10g}")
        applied_c = float((clip.params[0] - clip.params_initial).norm()) / CLIP_LR
        logged_c = clip.steps[0]["actor/grad_norm"]
        if logged <= 10 * TINY_CLIP:
            out.append(not_applicable("grad-norm-identity", b, f"gradient norm {logged:.3g} too "
                                      f"small for the clipping probe"))
            continue
        if not tol.close(applied_c, TINY_CLIP):
            problems.append(f"grad_clip={TINY_CLIP:g}: applied gradient norm {applied_c:.6g} "
                            f"(clipping not applied as configured)")
        if not tol.close(logged_c, logged):
            problems.append(f"grad_clip={TINY_CLIP:g}: logged grad_norm {logged_c:.10g} is not "
                            f"the pre-clip norm {logged:.10g}")
        out.append(result("grad-norm-identity", b, not problems, "; ".join(problems) or
                          f"logged grad_norm {logged:.6g} = applied gradient norm",
                          drift=abs(logged - applied) / max(applied, 1e-12)))
    return out


# ---- PPO epochs ------------------------------------------------------------------------------

def _epochs_variants(scn, batch):
    noclip = _gradnorm_variants(scn, batch)[0]
    two = base_variant(scn, batch, "epochs:2", **one_minibatch(scn, batch, **{
        "actor.ppo_epochs": 2}), **{"actor.optim.name": "sgd", "actor.optim.weight_decay": 0.0,
                                    "actor.grad_clip": 0.0, "actor.optim.lr": SGD_LR})
    return [noclip, two]


@invariant("ppo-epochs-identity", "identity", variants=_epochs_variants)
def ppo_epochs_identity(ctx: CheckContext):
    """``ppo_epochs = 2`` over one mini-batch takes a second SGD step (no momentum, weight decay
    or clipping) after the one a 1-epoch run takes: the parameters of the two runs differ by
    ``lr * |g_2|``, and ``actor/grad_norm`` (the mean over optimizer steps) is ``(|g_1| +
    |g_2|) / 2`` with ``|g_1|`` the 1-epoch run's norm, so ``||theta_2 - theta_1|| / lr = 2 *
    grad_norm_2 - grad_norm_1``. A trainer that drops ``ppo_epochs`` (or recomputes the old
    log-probs per epoch, which changes only later steps' ratios, not this identity) runs one
    step: its left side is 0."""
    out = []
    tol = ctx.scenario.tol("actor/grad_norm")
    for b in ctx.backends():
        runs, na = ctx.need("ppo-epochs-identity", b, "gradnorm:noclip", "epochs:2")
        if na:
            out.append(na)
            continue
        one, two = runs
        if not one.params or not two.params or "actor/grad_norm" not in two.steps[0]:
            out.append(not_applicable("ppo-epochs-identity", b, "parameters or actor/grad_norm "
                                      "not recorded"))
            continue
        if _half_params(one) or _half_params(two):
            out.append(not_applicable("ppo-epochs-identity", b, _HALF_WHY))
            continue
        moved = float((two.params[0] - one.params[0]).norm()) / SGD_LR
        want = 2 * two.steps[0]["actor/grad_norm"] - one.steps[0]["actor/grad_norm"]
        ok = tol.close(moved, want)
        out.append(result("ppo-epochs-identity", b, ok,
                          (f"the second epoch's step has norm {moved:.10g}, expected "
                           f"2 x grad_norm(2 epochs) - grad_norm(1 epoch) = {want:.10g}")
                          if not ok else f"second epoch's gradient norm {moved:.6g} as logged",
                          drift=abs(moved - want) / max(abs(want), 1e-12)))
    return out


# ---- KL-loss direction -----------------------------------------------------------------------

KL_COEF = 0.5
#: small enough that one SGD step on the KL term alone is first-order accurate on the tiny
#: models (measured: second-order share of the KL change < 5%), large enough to move KL well
#: beyond float noise
KL_LR = 1e-3
#: estimators that are > 0 whenever the policy differs from the reference
POSITIVE_KL = ("k2", "mse", "k3", "low_var_kl", "abs", "k3+", "low_var_kl+")


def _kl_direction_variants(scn, batch):
    v = base_variant(scn, batch, "kl:descent", steps=2, **one_minibatch(scn, batch), **{
        "algorithm.adv_estimator": "grpo", "algorithm.use_kl_in_reward": False,
        "algorithm.filter_groups.enable": False, "reward.overlong_buffer.enable": False,
        "actor.use_kl_loss": True, "actor.kl_loss_coef": KL_COEF, "actor.entropy_coeff": 0.0,
        "actor.rollout_correction.rollout_is": None,
        "actor.rollout_correction.use_rollout_kl_loss": False, "actor.distill.enable": False,
        "actor.optim.name": "sgd", "actor.optim.lr": KL_LR, "actor.optim.weight_decay": 0.0,
        "actor.grad_clip": 0.0})
    # equal scores: every GRPO advantage is 0, so the KL term is the whole gradient
    v.batch = batch.with_fields(scores=torch.zeros_like(batch["scores"]))
    return [v]


def same_reference(scn) -> str | None:
    """kl-loss-direction's trigger: a reference policy distinct from the actor."""
    return ("the reference policy is the initial actor: KL is 0" if scn.ref_model is None
            else None)


@invariant("kl-loss-direction", "identity", variants=_kl_direction_variants,
           trigger=same_reference)
def kl_loss_direction(ctx: CheckContext):
    """With the KL loss the only term (all scores equal, so GRPO advantages are 0; coefficient
    c = 0.5; plain SGD, no clipping), one optimizer step moves the policy *towards* the
    reference: ``actor/kl_loss`` falls from step 0 to step 1 (the first-order prediction
    ``lr * grad_norm^2 / c`` is reported, not required: a trainer may log the KL aggregated
    otherwise than its loss, as TRL does). A KL term added with the wrong sign raises the KL
    instead; one computed against the live actor instead of the reference policy is 0.
    Independent of config-effect, which only checks the loss value. n/a without a reference
    policy distinct from the actor (the KL is then 0)."""
    kind = ctx.variant("kl:descent").config.actor.kl_loss_type
    ref = ctx.runs.get("reference", {}).get("kl:descent")
    g_ref = ref.steps[0].get("actor/grad_norm") if ref is not None and ref.steps else None
    ref_pred = KL_LR * g_ref * g_ref / KL_COEF if g_ref is not None else None
    out = []
    for b in ctx.backends():
        runs, na = ctx.need("kl-loss-direction", b, "kl:descent")
        if na:
            out.append(na)
            continue
        steps = runs[0].steps
        if len(steps) < 2 or any("actor/kl_loss" not in s for s in steps[:2]):
            out.append(result("kl-loss-direction", b, False, "actor/kl_loss not logged at "
                              "steps 0 and 1 although use_kl_loss is true"))
            continue
        k0, k1 = steps[0]["actor/kl_loss"], steps[1]["actor/kl_loss"]
        g = steps[0].get("actor/grad_norm")
        problems = []
        if kind in POSITIVE_KL and not k0 > 0:
            problems.append(f"actor/kl_loss = {k0:.6g} at step 0 with a reference policy that "
                            f"is not the actor ({kind} is > 0 there)")
        pred = KL_LR * g * g / KL_COEF if g is not None else float("nan")
        tol = ctx.scenario.tol("actor/kl_loss")
        margin = tol.atol + tol.rtol * abs(k0)
        # judged by the reference's prediction (the oracle's gradient), or this run's own
        expect = ref_pred if ref_pred is not None else pred
        if not expect > 2 * margin:  # a correct step could not show its fall above tolerance
            out.append(not_applicable("kl-loss-direction", b, f"the predicted fall {expect:.3g} "
                                      f"is within twice the tolerance ({margin:.3g}) of this "
                                      f"precision: not resolvable"))
            continue
        if not k0 - k1 > margin:
            problems.append(f"one SGD step on the KL term changed actor/kl_loss {k0:.8g} -> "
                            f"{k1:.8g}: it must fall (first-order prediction: a fall of "
                            f"{pred:.3g} = lr * grad_norm^2 / coef)")
        out.append(result("kl-loss-direction", b, not problems, "; ".join(problems) or
                          f"KL fell {k0:.6g} -> {k1:.6g} (first-order prediction: a fall of "
                          f"{pred:.3g})"))
    return out
