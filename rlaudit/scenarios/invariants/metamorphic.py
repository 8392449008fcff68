"""Metamorphic relations (family 3) and no-mutation (family 2): results do not depend on how a
batch is cut, on row order, on padding, or on values under a zero mask; stages never change their
inputs."""

from __future__ import annotations

from rlaudit.metrics import golden_names, spec
from rlaudit.data.transforms import append_padding, permute_rows_within_blocks, perturb_masked
from rlaudit.scenarios.invariants.base import (CheckContext, base_variant, invariant,
                                               not_applicable, result)
from rlaudit.verdict.compare import compare_runs


def _mb_rows(scn, batch) -> int:
    return min(scn.config.actor.ppo_mini_batch_size * scn.config.rollout.n, len(batch))


#: the baseline the metamorphic variants compare with: the scenario's config, at most 2 steps
SHORT_BASE = "base:short"


def _base(scn, batch, name=None):
    return base_variant(scn, batch, SHORT_BASE, steps=min(scn.steps, 2))


def cut_invariant_metrics(scn, run) -> list[str] | None:
    """The metric names a re-cut of the batch must leave unchanged: every golden-compared one,
    except, when the scenario reduces metrics as micro-batch means
    (``trainer.metric_reduction``, a target's declared convention), the loss-term metrics:
    a mean of micro-batch means depends on the cut by definition (loss and update do not).
    None: every metric."""
    tr = scn.config.trainer
    if tr.metric_reduction != "microbatch-mean" and not tr.metric_reduction_except:
        return None
    names = {n for s in run.steps for n in golden_names(s)}
    return sorted(n for n in names if spec(n).reduction != "global"
                  or tr.metric_mode(n) == "contribution")


def _check_against_base(ctx: CheckContext, name: str, variant: str, label: str, *,
                        base: str = SHORT_BASE, recut: bool = False,
                        tokens_only: tuple[str, ...] | None = None, **kw):
    """``recut``: the variant cuts the batch into other micro-batches (see
    :func:`cut_invariant_metrics`). ``tokens_only``: compare only those per-token tensors (no
    metric, no parameter), the ones both runs returned; n/a where there are none."""
    out = []
    for b in ctx.backends():
        runs, na = ctx.need(name, b, variant, base)
        if na:
            out.append(na)
            continue
        got, want = runs
        if recut:
            kw["metrics"] = cut_invariant_metrics(ctx.scenario, want)
        if tokens_only is not None:
            shared = tuple(k for k in tokens_only if k in got.tokens and k in want.tokens)
            if not shared:
                out.append(not_applicable(name, b, f"{variant}: none of {list(tokens_only)} "
                                          f"returned"))
                continue
            kw.update(tokens=shared, metrics=[], params=False, metric_names_equal=False)
        # ``want`` is the baseline: its rows, widths and mask are the ones compared on (row_map
        # and width map ``got`` onto them)
        c = compare_runs(ctx.scenario, got, want, mask=ctx.mask(base), label=label, **kw)
        out.append(result(name, b, c.ok, c.message, c.details, c.drift))
    return out


# ---- micro-batch invariance ------------------------------------------------------------------

def _micro_variants(scn, batch):
    steps = min(scn.steps, 2)
    longest = int(batch.sequence_lengths().max())
    return [_base(scn, batch, "microbatch-invariance"),
            base_variant(scn, batch, "microbatch:1", steps=steps,
                         **{"actor.ppo_micro_batch_size_per_gpu": 1, "actor.use_dynamic_bsz": False,
                            "critic.ppo_micro_batch_size_per_gpu": 1}),
            base_variant(scn, batch, "microbatch:all", steps=steps,
                         **{"actor.ppo_micro_batch_size_per_gpu": _mb_rows(scn, batch),
                            "actor.use_dynamic_bsz": False,
                            "critic.ppo_micro_batch_size_per_gpu": _mb_rows(scn, batch)}),
            base_variant(scn, batch, "microbatch:tokens", steps=steps,
                         **{"actor.use_dynamic_bsz": True,
                            "actor.ppo_max_token_len_per_gpu": max(longest, 2 * longest - 3)})]


@invariant("microbatch-invariance", "metamorphic", variants=_micro_variants, partial=True)
def microbatch_invariance(ctx: CheckContext):
    """Cutting each mini-batch into micro-batches of 1 row, of all its rows, or by a token budget
    (use_dynamic_bsz) gives the same metrics, per-token log-probs/entropy and updated parameters
    as the scenario's own cut: losses are normalised by global (mini-batch) denominators, never
    per micro-batch."""
    out = []
    for v in ("microbatch:1", "microbatch:all", "microbatch:tokens"):
        for r in _check_against_base(ctx, "microbatch-invariance", v, v, recut=True):
            out.append(r)
    return _merge(out)


# ---- batch invariance ------------------------------------------------------------------------

@invariant("batch-invariance", "metamorphic", variants=_micro_variants)
def batch_invariance(ctx: CheckContext):
    """A row's log-probs and entropy do not depend on which other rows share its micro-batch:
    the initial policy's per-token outputs with one row per micro-batch equal those with the
    whole mini-batch in one micro-batch."""
    out = []
    for b in ctx.backends():
        runs, na = ctx.need("batch-invariance", b, "microbatch:1", "microbatch:all")
        if na:
            out.append(na)
            continue
        one, whole = runs
        c = compare_runs(ctx.scenario, one, whole, mask=ctx.mask("microbatch:all"), metrics=[],
                         params=False,
                         tokens=("probe_log_probs", "probe_entropy", "old_log_probs"),
                         metric_names_equal=False, label="1 row vs all rows per micro-batch")
        out.append(result("batch-invariance", b, c.ok, c.message, c.details, c.drift))
    return out


# ---- row permutation -------------------------------------------------------------------------

#: per-token values a step derives from the whole batch before any update: they belong to a
#: row, whichever mini-batch or rank it lands in
BEFORE_UPDATE = ("advantages", "returns", "token_level_rewards", "kl", "old_log_probs",
                 "ref_log_probs", "rollout_is_weights")
ACROSS_SEED = 4321


def _perm_variants(scn, batch):
    permuted, perm = permute_rows_within_blocks(batch, _mb_rows(scn, batch), seed=1234)
    v = base_variant(scn, permuted, "permutation", steps=min(scn.steps, 2))
    v.batch = permuted
    out = [_base(scn, batch, "row-permutation"), v]
    if _mb_rows(scn, batch) < len(batch):     # several mini-batches: shuffle across them too
        across, _ = permute_rows_within_blocks(batch, len(batch), seed=ACROSS_SEED)
        a = base_variant(scn, across, "permutation:across", steps=1)
        a.batch = across
        out.append(a)
    return out


@invariant("row-permutation", "metamorphic", variants=_perm_variants, partial=True)
def row_permutation(ctx: CheckContext):
    """Shuffling rows (within each mini-batch, so optimizer steps see the same rows) permutes
    every per-token output the same way and changes no metric or updated parameter: advantages
    are grouped by uid, not by position. With several mini-batches, rows are also shuffled
    across them (``permutation:across``: each mini-batch then holds rows of other groups) and
    what a step derives from the whole batch before the update (:data:`BEFORE_UPDATE`:
    advantages, returns, rewards, KL, old and reference log-probs) is compared row for row: a
    trainer computing advantages per mini-batch or per rank fails it (such a trainer is green
    wherever a mini-batch holds whole groups: the group statistics come out the same)."""
    scn = ctx.scenario
    _, perm = permute_rows_within_blocks(ctx.batch, _mb_rows(scn, ctx.batch), seed=1234)
    out = _check_against_base(ctx, "row-permutation", "permutation", "rows permuted",
                              row_map=perm, recut=True)
    if _mb_rows(scn, ctx.batch) < len(ctx.batch):
        _, across = permute_rows_within_blocks(ctx.batch, len(ctx.batch), seed=ACROSS_SEED)
        out += _check_against_base(ctx, "row-permutation", "permutation:across",
                                   "rows shuffled across mini-batches", row_map=across,
                                   tokens_only=BEFORE_UPDATE)
    return _merge(out)


# ---- padding appended ------------------------------------------------------------------------

def _padcol_variants(scn, batch):
    wide = append_padding(batch, prompt_cols=2, response_cols=3)
    extra = {}
    if scn.config.actor.loss_scale_factor is None:
        # seq-mean-token-sum-norm divides by R by definition; pin it so both runs use one constant
        extra["actor.loss_scale_factor"] = float(batch.response_width)
    base = base_variant(scn, batch, "padding-appended:base", steps=min(scn.steps, 2), **extra)
    v = base_variant(scn, wide, "padding:columns", steps=min(scn.steps, 2), **extra)
    v.batch = wide
    return [base, v]


@invariant("padding-appended", "metamorphic", variants=_padcol_variants)
def padding_appended(ctx: CheckContext):
    """Appending padding columns to prompts and responses (wider P and R, same tokens) changes
    no metric, per-token output (on the original columns) or updated parameter."""
    return _check_against_base(ctx, "padding-appended", "padding:columns", "padding appended",
                               base="padding-appended:base", width=ctx.batch.response_width)


# ---- values under a zero mask ----------------------------------------------------------------

def _masked_variants(scn, batch):
    v = base_variant(scn, perturb_masked(batch, seed=99), "masked:garbage", steps=min(scn.steps, 2))
    v.batch = perturb_masked(batch, seed=99)
    return [_base(scn, batch, "masked-values"), v]


@invariant("masked-values", "metamorphic", variants=_masked_variants)
def masked_values(ctx: CheckContext):
    """Overwriting every value no computation may read (prompt/response ids past their lengths,
    float per-token fields where response_mask is False) changes no metric, valid per-token output
    or updated parameter."""
    return _check_against_base(ctx, "masked-values", "masked:garbage", "garbage under mask")


# ---- context-parallel size -------------------------------------------------------------------

#: CP size of the cp-invariance variant when no backend's layout declares one
DEFAULT_CP = 2


def cp_size(scn) -> int:
    """The CP size the variant uses: the largest ``cp`` a backend's layout declares, else 2."""
    declared = [int(layout.get("cp", 1)) for layout in scn.backends.values()]
    return max([c for c in declared if c > 1], default=DEFAULT_CP)


def _cp_variants(scn, batch):
    size = cp_size(scn)
    return [_base(scn, batch),
            base_variant(scn, batch, f"cp:{size}", steps=min(scn.steps, 2),
                         **{"actor.context_parallel_size": size})]


@invariant("cp-invariance", "metamorphic", variants=_cp_variants)
def cp_invariance(ctx: CheckContext):
    """Dividing every sequence's tokens over ``cp`` context-parallel ranks
    (``actor.context_parallel_size``; load-balanced 2*cp chunks, rlaudit/data/context_parallel.py)
    changes no metric, per-token output or updated parameter: each rank's partial loss, gradient
    and metric sums are reduced over the CP group exactly once and never rescaled by ``cp``. The
    size is the ``cp`` a backend's layout declares (an adapter's ``layout = {"cp": N}``), else 2;
    rlaudit's backends simulate the CP group in the shared update step."""
    size = cp_size(ctx.scenario)
    return _check_against_base(ctx, "cp-invariance", f"cp:{size}",
                               f"context_parallel_size {size} vs 1")


# ---- no input mutation -----------------------------------------------------------------------

@invariant("no-input-mutation", "no-mutation")
def no_input_mutation(ctx: CheckContext):
    """No stage of a step changes the batch it was handed: every tensor of every variant's input
    batch is bit-identical, with an unchanged version counter, after the run."""
    out = []
    for b in ctx.backends():
        bad = [name for name, run in ctx.runs[b].items() if not run.inputs_unchanged]
        out.append(result("no-input-mutation", b, not bad,
                          f"input batch modified in place in variant(s) {bad}" if bad else
                          f"{len(ctx.runs[b])} variant inputs unchanged"))
    return out


#: how parts of one invariant combine per backend: the first status in this order wins
_MERGE_ORDER = ("error", "fail", "pass", "n/a")


def _merge(results):
    """One result per backend: fail if any part failed (messages joined), else pass if any part
    passed (parts that were n/a named in the message), else n/a."""
    by_backend: dict[str, list] = {}
    for r in results:
        by_backend.setdefault(r.backend, []).append(r)
    out = []
    for parts in by_backend.values():
        status = next(s for s in _MERGE_ORDER if any(p.status == s for p in parts))
        chosen = [p for p in parts if p.status == status]
        first = chosen[0]
        first.message = "; ".join(p.message for p in chosen)
        skipped = [p.message for p in parts if p.status == "n/a"] if status == "pass" else []
        if skipped:
            first.message += " (not run: " + "; ".join(skipped) + ")"
        first.drift = max((p.drift or 0.0) for p in parts)
        out.append(first)
    return out

