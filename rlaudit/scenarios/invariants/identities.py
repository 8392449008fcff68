"""Identities (family 4), config effect (family 5) and the grad-norm identity (family 8).

All of them look at step 0 of a variant that makes the step one on-policy optimizer step over the
whole batch (ppo_epochs = 1, one mini-batch): there the new policy equals the old one, so
ratio = 1, clip fraction 0, ppo_kl 0, KL to an identical reference 0, and the policy-gradient
loss has a closed form in the advantages that is recomputed here by a naive loop.
"""

from __future__ import annotations

from rlaudit.scenarios.invariants.base import (CheckContext, base_variant, invariant,
                                               not_applicable, result)
from rlaudit.scenarios.invariants.naive import naive_agg
from rlaudit.scenarios.invariants.seeds import one_minibatch

AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def expected_pg_loss(run, mask, cfg) -> float:
    """Closed-form on-policy pg_loss: agg(-A * w) for vanilla/gspo (ratio 1), agg(-A * w * logp)
    for cispo (whose surrogate is -clip(ratio).detach() * A * log_prob)."""
    t = run.tokens
    per_token = -t["advantages"].double()
    if cfg.actor.rollout_correction.rollout_is is not None:
        per_token = per_token * t["rollout_is_weights"].double()
    if cfg.actor.loss_mode == "cispo":
        per_token = per_token * t["probe_log_probs"].double()
    return naive_agg(per_token, mask, cfg.actor.loss_agg_mode, cfg.actor.loss_scale_factor)


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
    the reference policy is the initial actor."""
    out = []
    scn = ctx.scenario
    cfg = _cfg(ctx, "onpolicy")
    mask = ctx.batch.mask
    for b in ctx.backends():
        runs, na = ctx.need("on-policy-identities", b, "onpolicy")
        if na:
            out.append(na)
            continue
        run = runs[0]
        m = run.steps[0]
        problems = []

        unlogged = []

        def near(name, want, what):
            got = m.get(name)
            if got is None:     # a name a backend never logs is compared by backend-parity
                unlogged.append(name)
            elif not scn.tol(name).close(got, want):
                problems.append(f"{name} = {got:.10g}, {what} {want:.10g}")

        for name in ("actor/pg_clipfrac", "actor/pg_clipfrac_lower"):
            if m.get(name, 0.0) != 0.0:
                problems.append(f"{name} = {m[name]:.6g} on an on-policy step (ratio is 1)")
        near("actor/ppo_kl", 0.0, "on-policy value")
        want_pg = expected_pg_loss(run, mask, cfg)
        near("actor/pg_loss", want_pg, "closed form")
        if cfg.compute_entropy:
            near("actor/entropy", naive_agg(run.tokens["probe_entropy"], mask,
                                            cfg.actor.loss_agg_mode, cfg.actor.loss_scale_factor),
                 "recomputed")
        if cfg.actor.use_kl_loss and scn.ref_model is None:
            near("actor/kl_loss", 0.0, "policy = reference, expected")
        drift = abs(m.get("actor/pg_loss", 0.0) - want_pg) / max(abs(want_pg), 1e-12)
        if "actor/pg_loss" in unlogged:
            problems.append("actor/pg_loss not logged")
        skipped = f" (not logged, not checked: {', '.join(unlogged)})" if unlogged else ""
        out.append(result("on-policy-identities", b, not problems, "; ".join(problems) or
                          f"ratio-1 identities hold (pg_loss = {want_pg:.6g}){skipped}",
                          drift=drift))
    return out


# ---- config effect ---------------------------------------------------------------------------

def _config_variants(scn, batch):
    o = one_minibatch(scn, batch)
    vs = [base_variant(scn, batch, "cfg:entropy0", **o, **{"actor.entropy_coeff": 0.0,
                                                           "actor.calculate_entropy": True}),
          base_variant(scn, batch, "cfg:entropy", **o, **{"actor.entropy_coeff": 0.01,
                                                          "actor.calculate_entropy": True}),
          base_variant(scn, batch, "cfg:kl0", **o, **{"actor.use_kl_loss": True,
                                                      "actor.kl_loss_coef": 0.0}),
          base_variant(scn, batch, "cfg:kl", **o, **{"actor.use_kl_loss": True,
                                                     "actor.kl_loss_coef": 0.5})]
    for mode in AGG_MODES:
        vs.append(base_variant(scn, batch, f"cfg:agg:{mode}", **o,
                               **{"actor.loss_agg_mode": mode, "actor.loss_mode": "vanilla"}))
    return vs


@invariant("config-effect", "config-effect", variants=_config_variants)
def config_effect(ctx: CheckContext):
    """Every knob changes the result exactly as the reference semantics say (on one on-policy
    step): ``entropy_coeff = c`` lowers ``actor/loss`` by ``c * actor/entropy`` relative to
    ``c = 0``; ``kl_loss_coef = c`` raises it by ``c * actor/kl_loss``; each ``loss_agg_mode``
    gives ``pg_loss = agg(-A)`` under that mode. Run on every backend, these variants are also
    compared across backends by backend-parity, so a flag one backend ignores shows up twice."""
    out = []
    scn = ctx.scenario
    mask = ctx.batch.mask
    names = ["cfg:entropy0", "cfg:entropy", "cfg:kl0", "cfg:kl"] + [f"cfg:agg:{m}" for m in AGG_MODES]
    for b in ctx.backends():
        problems = []
        runs, na = ctx.need("config-effect", b, *names)
        if na:
            out.append(na)
            continue
        e0, e = runs[0].steps[0], runs[1].steps[0]
        if "actor/entropy" not in e:
            problems.append("entropy_coeff = 0.01: actor/entropy not logged")
        else:
            want = e0["actor/loss"] - 0.01 * e["actor/entropy"]
            if not scn.tol("actor/loss").close(e["actor/loss"], want):
                problems.append(f"entropy_coeff = 0.01: actor/loss = {e['actor/loss']:.10g}, "
                                f"expected loss(coeff 0) - 0.01 * entropy = {want:.10g}")
        k0, k = runs[2].steps[0], runs[3].steps[0]
        if "actor/kl_loss" not in k:
            problems.append("use_kl_loss: actor/kl_loss not logged")
        else:
            want = k0["actor/loss"] + 0.5 * k["actor/kl_loss"]
            if not scn.tol("actor/loss").close(k["actor/loss"], want):
                problems.append(f"kl_loss_coef = 0.5: actor/loss = {k['actor/loss']:.10g}, "
                                f"expected loss(coef 0) + 0.5 * kl_loss = {want:.10g}")
        for mode in AGG_MODES:
            run = ctx.run(b, f"cfg:agg:{mode}")
            want = expected_pg_loss(run, mask, _cfg(ctx, f"cfg:agg:{mode}"))
            got = run.steps[0]["actor/pg_loss"]
            if not scn.tol("actor/pg_loss").close(got, want):
                problems.append(f"loss_agg_mode {mode}: pg_loss = {got:.10g}, expected "
                                f"agg(-A) = {want:.10g}")
        out.append(result("config-effect", b, not problems, "; ".join(problems) or
                          "entropy_coeff, kl_loss_coef and every loss_agg_mode act as specified"))
    return out


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

