"""The four seed invariants (docs/findings.md, seeds): the bugs rlaudit was founded on, stated
generally."""

from __future__ import annotations

from rlaudit.algo.kl import kl_penalty
from rlaudit.algo.reward import place_scores
from rlaudit.data.batch import Kind
from rlaudit.scenarios.invariants.base import (CheckContext, base_variant, invariant,
                                               not_applicable, result)
from rlaudit.scenarios.invariants.logged import logged_agg, microbatch_rows
from rlaudit.scenarios.invariants.loss_layouts import check_nested_losses
from rlaudit.update.step import sequence_scores
from rlaudit.verdict.compare import compare_runs
from rlaudit.verdict.tensors import compare_tensors


def one_minibatch(scn, batch, **extra) -> dict:
    """Overrides that make step 0 a single on-policy optimizer step over the whole batch."""
    n = scn.config.rollout.n
    return {"actor.ppo_mini_batch_size": -(-len(batch) // n), "actor.ppo_epochs": 1, **extra}


# ---- 1. entropy logged when its coefficient is zero (verl PR #6016) ---------------------------

def _entropy_variants(scn, batch):
    o = one_minibatch(scn, batch)
    return [base_variant(scn, batch, "entropy:calc", **o, **{"actor.entropy_coeff": 0.0,
                                                             "actor.calculate_entropy": True}),
            base_variant(scn, batch, "entropy:off", **o, **{"actor.entropy_coeff": 0.0,
                                                            "actor.calculate_entropy": False})]


@invariant("entropy-logged-when-coeff-zero", "seed", variants=_entropy_variants)
def entropy_logged(ctx: CheckContext):
    """With ``entropy_coeff = 0`` and ``calculate_entropy = true``, every backend logs
    ``actor/entropy``, its value is the policy entropy aggregated with ``loss_agg_mode`` over the
    batch (recomputed here from the per-token entropy of the initial policy: on a single on-policy
    optimizer step the update sees exactly that policy; for a backend that reduces it as a
    micro-batch mean, the mean over its micro-batches of each one's aggregate), and the loss,
    gradient and updated parameters equal those of the run with ``calculate_entropy = false``
    (entropy is logged, not optimised)."""
    out = []
    scn = ctx.scenario
    mask = ctx.mask("entropy:calc")
    for b in ctx.backends():
        runs, na = ctx.need("entropy-logged-when-coeff-zero", b, "entropy:calc", "entropy:off")
        if na:
            out.append(na)
            continue
        calc, off = runs
        m = calc.steps[0]
        if "actor/entropy" not in m:
            out.append(result("entropy-logged-when-coeff-zero", b, False,
                              "actor/entropy is not logged although calculate_entropy is true "
                              "(entropy_coeff = 0)"))
            continue
        cfg = run_cfg(ctx, "entropy:calc")
        reduced = cfg.trainer.metric_mode("actor/entropy")
        want = logged_agg("actor/entropy", calc.tokens["probe_entropy"], mask, cfg,
                          microbatch_rows(calc, cfg, ctx.batch_of("entropy:calc")))
        if want is None:
            out.append(not_applicable("entropy-logged-when-coeff-zero", b, "actor/entropy is "
                                      "reduced as a micro-batch mean and the micro-batches' rows "
                                      "are unknown (micro-batch records do not fit the batch)"))
            continue
        tol = scn.tol("actor/entropy")
        problems = []
        if not tol.close(m["actor/entropy"], want):
            how = ("" if reduced == "contribution"
                   else ", averaged over micro-batches (metric_reduction microbatch-mean),")
            problems.append(f"actor/entropy = {m['actor/entropy']:.10g}, but the policy's entropy "
                            f"aggregated with {cfg.actor.loss_agg_mode}{how} is {want:.10g}")
        same = compare_runs(scn, calc, off, mask=mask, metric_names_equal=False,
                            metrics=["actor/loss", "actor/pg_loss", "actor/grad_norm"],
                            tokens=(), label="calculate_entropy true vs false")
        if not same.ok:
            problems.append(same.message + " — computing entropy with coefficient 0 changed the "
                            "update")
        out.append(result("entropy-logged-when-coeff-zero", b, not problems,
                          "; ".join(problems) or f"actor/entropy = {m['actor/entropy']:.6g} logged "
                          f"and equal to the recomputed value; loss unchanged",
                          drift=abs(m["actor/entropy"] - want) / max(abs(want), 1e-12)))
    return out


# ---- 2. stored KL unaltered by reward shaping (slime PR #2114) --------------------------------

def _kl_variants(scn, batch):
    return [base_variant(scn, batch, "kl-in-reward", **{"algorithm.use_kl_in_reward": True})]


@invariant("stored-kl-unaltered", "seed", variants=_kl_variants)
def stored_kl_unaltered(ctx: CheckContext):
    """With KL in the reward, the stored per-token KL read at the *end* of the step equals
    ``kl_penalty(old_log_probs, ref_log_probs) * mask`` recomputed from the step's log-probs, the
    logged ``rollout/kl`` is its token-mean, and the token-level rewards are
    ``scores_on_last_token - kl_coef * kl`` — so no stage overwrote the stored KL in place (e.g. by
    building the shaped reward in an aliased tensor)."""
    out = []
    scn = ctx.scenario
    mask = ctx.mask("kl-in-reward")
    batch = ctx.batch_of("kl-in-reward")
    alg = scn.config.algorithm
    for b in ctx.backends():
        runs, na = ctx.need("stored-kl-unaltered", b, "kl-in-reward")
        if na:
            out.append(na)
            continue
        run = runs[0]
        t = run.tokens
        if "kl" not in t:
            out.append(result("stored-kl-unaltered", b, False, "no stored KL tensor after a step "
                              "with use_kl_in_reward"))
            continue
        kl = kl_penalty(t["old_log_probs"].double(), t["ref_log_probs"].double(),
                        alg.kl_penalty, k3_clamp=alg.k3_clamp) * mask
        problems = []
        ok, msg, det = compare_tensors("stored kl", t["kl"], kl, scn.tol("kl"), mask)
        if not ok:
            problems.append(msg)
        want_mean = float((kl * mask).sum() / mask.sum().clamp_min(1))
        got_mean = run.steps[0].get("rollout/kl")
        if got_mean is None:
            problems.append("rollout/kl is not logged")
        elif not scn.tol("rollout/kl").close(got_mean, want_mean):
            problems.append(f"rollout/kl = {got_mean:.10g}, recomputed KL mean {want_mean:.10g}")
        seq, _ = sequence_scores(batch, run_cfg(ctx, "kl-in-reward"))
        scores = place_scores(seq, batch["response_lengths"], batch.response_width).double()
        rewards = scores - alg.kl_coef * kl
        ok, msg, _ = compare_tensors("token_level_rewards", t["token_level_rewards"], rewards,
                                     scn.tol("token_level_rewards"), mask)
        if not ok:
            problems.append(msg)
        out.append(result("stored-kl-unaltered", b, not problems, "; ".join(problems) or
                          f"stored KL intact (rollout/kl = {got_mean:.6g})", det))
    return out


# ---- 3. padding micro-batches complete (SkyRL PR #1811) ---------------------------------------

def _padding_variants(scn, batch):
    return [base_variant(scn, batch, "padding:extra", steps=1,
                         **{"trainer.extra_padding_microbatches": 2}),
            base_variant(scn, batch, "padding:none", steps=1)]


@invariant("padding-microbatches-complete", "seed", variants=_padding_variants)
def padding_complete(ctx: CheckContext):
    """Padding micro-batches (response_mask all False, added so every rank runs equally many
    passes) carry every per-token field the real micro-batches of the same optimizer step carry,
    with the same dtypes and trailing shapes; asking for two per optimizer step
    (``trainer.extra_padding_microbatches``) runs at least two more passes on every rank, and
    changes no metric, per-token output or updated parameter."""
    out = []
    scn = ctx.scenario
    token_fields = set(ctx.batch.fields_of(Kind.TOKEN))
    for b in ctx.backends():
        problems = []
        runs, na = ctx.need("padding-microbatches-complete", b, "padding:extra", "padding:none")
        if na:
            out.append(na)
            continue
        extra, none_ = runs
        seen_padding = 0
        for run in ctx.runs[b].values():
            for step, ranks in enumerate(run.micro_log):
                for rank, opt_steps in enumerate(ranks):
                    for k, micros in enumerate(opt_steps):
                        real = [m for m in micros if not m["padding"]]
                        ref_fields = real[0]["fields"] if real else micros[0]["fields"]
                        for j, m in enumerate(micros):
                            seen_padding += m["padding"]
                            missing = set(ref_fields) - set(m["fields"])
                            wrong = {f for f in set(ref_fields) & set(m["fields"])
                                     if m["fields"][f][1:] != ref_fields[f][1:]}
                            if missing or wrong:
                                problems.append(
                                    f"variant {run.name} step {step} rank {rank} optimizer step "
                                    f"{k} micro-batch {j}{' (padding)' if m['padding'] else ''}: "
                                    f"missing {sorted(missing)}, dtype/shape differs "
                                    f"{sorted(wrong)}")
                        lacking = token_fields - set(ref_fields)
                        if lacking and not problems:
                            problems.append(f"micro-batches lack the batch's per-token fields "
                                            f"{sorted(lacking)}")
        if not seen_padding and extra.micro_log:
            problems.append("no padding micro-batch was run although two were requested per "
                            "optimizer step")
        elif extra.micro_log and none_.micro_log:
            # counted, not recognised by an empty mask: a real micro-batch of empty responses
            # also has no valid token
            more = [[len(e) - len(n) for e, n in zip(re, rn)]
                    for re, rn in zip(extra.micro_log[0], none_.micro_log[0])]
            if any(d < 2 for rank in more for d in rank):
                problems.append(f"extra_padding_microbatches = 2 added {more} micro-batches per "
                                f"rank and optimizer step (at least 2 expected)")
        same = compare_runs(scn, extra, none_, mask=ctx.mask("padding:none"),
                            label="with 2 padding micro-batches vs none")
        if not same.ok:
            problems.append(same.message)
        out.append(result("padding-microbatches-complete", b, not problems,
                          "; ".join(problems[:3]) or f"{seen_padding} padding micro-batches "
                          f"complete and without effect", drift=same.drift))
    return out


# ---- 4. nested (jagged) inputs match padded ones (verl PR #5997) ------------------------------

@invariant("nested-matches-padded", "seed")
def nested_matches_padded(ctx: CheckContext):
    """Every loss whose inputs may arrive as ``torch.nested`` jagged tensors (the distillation
    losses, the KL estimators) gives the same per-token values and gradients on the jagged batch
    as on the padded batch with a mask — checked on this scenario's rows (ragged lengths,
    length-0 and length-1 responses included) against the reference implementation."""
    return [check_nested_losses(ctx, "reference")]


def run_cfg(ctx: CheckContext, variant: str):
    """The config a variant ran with (rebuilt exactly as the engine built it)."""
    for v in ctx.variants:
        if v.name == variant:
            return v.config
    raise KeyError(variant)
