"""Stage checks of ``make_microbatches`` and ``train_step`` (registered into checks.STAGE_CHECKS).

Micro-batching is checked on a 12-row batch with optional fields of every shape kind (a sequence
field, per-token floats, a ``[B, R, K]`` integer field and a field rlaudit does not know), under
several layouts: by count and by token budget, dp = 1..6. Under a token budget contiguous shards
of long and short rows need different numbers of micro-batches, so ranks must be padded (three
layouts, padding on different ranks). Cutting by count gives every rank the same number, so two
count layouts ask for ``extra_padding`` micro-batches per rank (a cutter that takes the argument:
its padding path, like ``trainer.extra_padding_microbatches`` at run level); a cutter without it
still runs them, unpadded.

train_step is run on the built-in rollout (:mod:`rlaudit.targets.inputs.builtin`) three times:
once with one step, then once with two, to see whether anything it returned changes afterwards.
"""

from __future__ import annotations

from typing import Mapping, NamedTuple

import torch

from rlaudit.data.batch import Kind, RolloutBatch
from rlaudit.targets.contract.adapter import accepts, metric_floats, supports
from rlaudit.targets.contract.guard import AdapterRaised, batch_state, unchanged_since
from rlaudit.targets.inputs import builtin
from rlaudit.targets.stages.common import row_key, same_mask
from rlaudit.targets.stages.registry import StageEnv, attempt, stage_check
from rlaudit.verdict.result import NA, CheckResult
from rlaudit.verdict.unsupported import UnsupportedFeature

#: (dp_size, micro_batch_size, max_token_len, extra_padding): exactly one of micro_batch_size and
#: max_token_len is set. Padding micro-batches arise at (2, None, 16) on rank 1, (3, None, 12) on
#: ranks 1-2, (4, None, 11) on ranks 2-3 (token budgets), and on every rank at the two layouts with
#: extra_padding (count cutters that accept it)
LAYOUTS = ((1, 4, None, 0), (4, 2, None, 0), (2, 3, None, 1), (6, 4, None, 0), (3, 2, None, 2),
           (2, None, 16, 0), (3, None, 12, 0), (4, None, 11, 0))
ROWS = 12
WIDTH_P, WIDTH_R, TOPK = 4, 6, 3


def microbatch_input() -> RolloutBatch:
    """12 rows, 3 groups; long rows first so contiguous shards differ in token counts; every row
    has a distinct first prompt token (100 + i) so rows can be recognised after re-cutting."""
    g = torch.Generator().manual_seed(7)
    pl = torch.tensor([4, 4, 3, 4, 3, 4, 2, 1, 2, 1, 2, 1])
    rl = torch.tensor([6, 5, 6, 6, 4, 5, 1, 0, 2, 1, 0, 3])
    mask = torch.arange(WIDTH_R).unsqueeze(0) < rl.unsqueeze(1)
    mask[3, 2] = False                                   # a hole inside a response
    prompt_ids = torch.randint(0, 50, (ROWS, WIDTH_P), generator=g)
    prompt_ids[:, 0] = 100 + torch.arange(ROWS)
    tensors = {
        "prompt_ids": prompt_ids, "prompt_lengths": pl,
        "response_ids": torch.randint(0, 50, (ROWS, WIDTH_R), generator=g),
        "response_lengths": rl, "response_mask": mask,
        "uid": torch.tensor([5, 9, 2] * 4, dtype=torch.int64),
        "scores": torch.rand(ROWS, generator=g, dtype=torch.float64),
        "old_log_probs": -torch.rand(ROWS, WIDTH_R, generator=g, dtype=torch.float64),
        "advantages": torch.randn(ROWS, WIDTH_R, generator=g, dtype=torch.float64),
        "rollout_log_probs": -torch.rand(ROWS, WIDTH_R, generator=g, dtype=torch.float64),
        "teacher_topk_ids": torch.randint(0, 50, (ROWS, WIDTH_R, TOPK), generator=g),
        "loss_weights": torch.rand(ROWS, WIDTH_R, generator=g, dtype=torch.float32),
    }
    return RolloutBatch.from_tensors(tensors, kinds={"loss_weights": Kind.TOKEN},
                                     source="rlaudit.targets.stages.batch")


_KEY_FIELDS = ("prompt_ids", "prompt_lengths", "response_ids", "response_lengths")


def _layout_label(dp, mbs, tokens, extra=0) -> str:
    return (f"dp={dp}, " + (f"micro_batch_size={mbs}" if mbs else f"max_token_len={tokens}")
            + (f", extra_padding={extra}" if extra else ""))


def _cut(env: StageEnv, batch: RolloutBatch, dp, mbs, tokens, extra=0):
    """The adapter's micro-batches for one layout as per-rank lists of tensor dicts
    (``extra_padding`` only passed to a cutter that takes it)."""
    kw = {"dp_size": dp}
    if mbs is not None:
        kw["micro_batch_size"] = mbs
    else:
        if not accepts(env.adapter.make_microbatches, "max_token_len"):
            raise NotImplementedError("make_microbatches takes no max_token_len")
        kw["max_token_len"] = tokens
    if extra and accepts(env.adapter.make_microbatches, "extra_padding"):
        kw["extra_padding"] = extra
    out, _ = env.call("make_microbatches", batch, label=_layout_label(dp, mbs, tokens, extra),
                      **kw)
    if not isinstance(out, (list, tuple)) or not all(isinstance(r, (list, tuple)) for r in out):
        raise AdapterRaised("make_microbatches", TypeError(
            f"expected a list (per rank) of lists of micro-batches, got {type(out).__name__}"))
    ranks = []
    for rank in out:
        micros = []
        for mb in rank:
            if isinstance(mb, RolloutBatch):
                micros.append(dict(mb.tensors))
            elif isinstance(mb, Mapping):
                micros.append(dict(mb))
            else:
                raise AdapterRaised("make_microbatches", TypeError(
                    f"a micro-batch must be a RolloutBatch or a dict of tensors, got "
                    f"{type(mb).__name__}"))
        ranks.append(micros)
    return ranks


class Layout(NamedTuple):
    """One entry of :data:`LAYOUTS`: exactly one of micro_batch_size and max_token_len is set."""

    dp: int
    micro_batch_size: int | None
    max_token_len: int | None
    extra_padding: int = 0


def layouts(env: StageEnv, check: str, body, *, token_budgets_only: bool = False
             ) -> CheckResult:
    """``body(tally, batch, label, layout, ranks)`` for every input batch and layout (only the
    token-budget ones with ``token_budgets_only``), ``ranks`` the adapter's cut."""
    t = env.tally(check)
    for batch in env.setting("microbatch_inputs", None) or [microbatch_input()]:
        for layout in map(Layout._make, env.setting("layouts", LAYOUTS)):
            if token_budgets_only and layout.max_token_len is None:
                continue
            label = _layout_label(*layout)
            attempt(t, label, lambda: body(t, batch, label, layout, _cut(env, batch, *layout)))
    return t


@stage_check("make_microbatches", "tokens-exactly-once", "metamorphic")
def tokens_exactly_once(env: StageEnv) -> CheckResult:
    """Every row of the batch that has a valid token appears in exactly one micro-batch of one
    rank, with its response mask unchanged; any other row a micro-batch holds (padding) has no
    valid token. So every loss term is counted exactly once."""
    def body(t, batch, label, layout, ranks):
        want = {row_key(batch.tensors, i): batch.mask[i] for i in range(len(batch))
                if bool(batch.mask[i].any())}
        seen: dict[tuple, int] = {}
        t.checked += 1
        if len(ranks) != layout.dp:
            t.fail(f"{label}: {len(ranks)} rank lists for dp_size={layout.dp}")
            return
        for r, micros in enumerate(ranks):
            for j, mb in enumerate(micros):
                mask = mb["response_mask"].bool()
                for i in range(mask.shape[0]):
                    key = (row_key(mb, i) if all(k in mb for k in _KEY_FIELDS) else None)
                    if key in want and same_mask(mask[i], want[key]):
                        seen[key] = seen.get(key, 0) + 1
                    elif bool(mask[i].any()):
                        t.fail(f"{label}: rank {r} micro-batch {j} row {i} has valid tokens but "
                               f"is not a row of the batch (or its mask changed)")
        missing = [k for k in want if k not in seen]
        twice = [k for k, n in seen.items() if n > 1]
        if missing:
            t.fail(f"{label}: {len(missing)} row(s) with valid tokens are in no micro-batch")
        if twice:
            t.fail(f"{label}: {len(twice)} row(s) are in more than one micro-batch")
    return layouts(env, "make_microbatches:tokens-exactly-once", body).result(
        "layouts cut every valid token exactly once")


@stage_check("make_microbatches", "equal-count-per-rank", "distributed")
def equal_count(env: StageEnv) -> CheckResult:
    """Every data-parallel rank gets the same number of micro-batches (padding micro-batches make
    up the difference), so no rank waits in a collective the others never reach."""
    def body(t, batch, label, layout, ranks):
        t.checked += 1
        counts = [len(r) for r in ranks]
        if len(set(counts)) > 1:
            t.fail(f"{label}: micro-batches per rank differ: {counts}")
    return layouts(env, "make_microbatches:equal-count-per-rank", body).result(
        "layouts give every rank the same count")


#: what a row counts against a token budget, per value of the ``token_budget`` convention
#: (rlaudit.targets.contract.declare.CONVENTIONS; the first is the reference's)
BUDGET_COUNTS = {"prompt+response": "prompt + response", "response": "response"}


@stage_check("make_microbatches", "within-token-budget", "metamorphic")
def within_token_budget(env: StageEnv) -> CheckResult:
    """Under a token budget of B tokens per micro-batch, both bounds hold. Upper: every
    micro-batch holding more than one row holds at most B tokens (a cutter that picks
    ceil(T / B) micro-batches and balances rows over them can overfill one: verl before PR
    #7553, https://github.com/verl-project/verl/pull/7553, fixed in 0.9.1). Lower: a rank whose
    rows hold T tokens gets at least ceil(T / B) micro-batches (fewer, and some micro-batch holds
    more than B: pigeonhole). T counts what the budget counts under the declared ``token_budget``
    convention: by default what the model processes for each row, prompt and response tokens
    alike (verl's ``ppo_max_token_len_per_gpu`` sums the attention mask, SkyRL's token iterator
    too), or the response tokens only where the target declares ``token_budget: response``;
    taken from the batch for the rows with a valid token only (a row without one is not
    counted, so neither bound can fail on a row a trainer may leave out). A row longer than B
    alone in its micro-batch is within its contract (no trainer splits a row), and a rank
    holding one is left out of the lower bound (verl asserts that away); layouts by count are
    not this check's."""
    check = "make_microbatches:within-token-budget"
    counts = env.conventions(check).get("token_budget", "prompt+response")
    what = BUDGET_COUNTS[counts]
    hint = " (are the prompt tokens left out of the count?)" if counts == "prompt+response" else ""

    def body(t, batch, label, layout, ranks):
        seq = (batch.sequence_lengths() if counts == "prompt+response"
               else batch["response_lengths"]).tolist()
        where = {row_key(batch.tensors, i): seq[i] for i in range(len(batch))}
        budget = layout.max_token_len
        for r, micros in enumerate(ranks):
            per_micro = [_held_lengths(mb, where) for mb in micros]
            for j, rows in enumerate(per_micro):
                if len(rows) < 2:
                    continue
                t.checked += 1
                if sum(rows) > budget:
                    t.fail(f"{label}: rank {r} micro-batch {j} holds {sum(rows)} tokens ({what} "
                           f"of {len(rows)} rows: {rows}) over the budget of {budget} per "
                           f"micro-batch")
            held = [n for rows in per_micro for n in rows]
            if not held or max(held) > budget:
                continue
            t.checked += 1
            need = -(-sum(held) // budget)
            if len(micros) < need:
                t.fail(f"{label}: rank {r} has {len(micros)} micro-batch(es) for {sum(held)} "
                       f"tokens ({what}) under a budget of {budget} per micro-batch: at least "
                       f"{need} needed{hint}")
    return layouts(env, check, body, token_budgets_only=True).result(
        f"token-budget layouts keep every micro-batch within the budget ({what} tokens) and "
        "give every rank enough micro-batches")


def _held_lengths(mb: Mapping[str, torch.Tensor], where: Mapping[tuple, int]) -> list[int]:
    """Budgeted lengths (from the batch, ``where``: row key -> length) of the rows of
    ``mb`` that have a valid token; empty when ``mb`` lacks the fields that identify rows."""
    if not all(f in mb for f in _KEY_FIELDS + ("response_mask",)):
        return []
    return [where[key] for i in range(mb["response_mask"].shape[0])
            if (key := row_key(mb, i)) in where and bool(mb["response_mask"][i].any())]


def _signature(mb: Mapping[str, torch.Tensor]) -> dict[str, tuple]:
    """field -> (dtype, number of dims, trailing shape past [rows, width])."""
    return {k: (v.dtype, v.dim(), tuple(v.shape[2:])) for k, v in mb.items()
            if isinstance(v, torch.Tensor)}


def _is_padding(mb: Mapping[str, torch.Tensor]) -> bool:
    mask = mb.get("response_mask")
    return isinstance(mask, torch.Tensor) and not bool(mask.bool().any())


@stage_check("make_microbatches", "padding-complete", "seed")
def padding_complete(env: StageEnv) -> CheckResult:
    """Every micro-batch of a layout — padding ones (response mask all False) included — carries
    every field of the trainer's own real micro-batches of that layout, with the same dtype,
    number of dimensions and trailing shape (extra placeholder fields are harmless) (SkyRL PR
    #1811: padding built from a hard-coded key list dropped ``rollout_log_probs`` and the loss
    raised inside the distributed backward).
    The comparison is with the trainer's real micro-batches, not with rlaudit's field list: a
    trainer need not carry fields it never uses, but its padding must look like its data."""
    def body(t, batch, label, layout, ranks):
        t.checked += 1
        real = [(r, j, mb) for r, micros in enumerate(ranks) for j, mb in enumerate(micros)
                if not _is_padding(mb)]
        if not real and bool(batch.mask.any()):
            t.fail(f"{label}: no micro-batch holds a valid token")
            return
        # a batch without any valid token: every micro-batch is padding, compared with the first
        real = real or [(r, j, mb) for r, micros in enumerate(ranks)
                        for j, mb in enumerate(micros)][:1]
        if not real:
            t.fail(f"{label}: no micro-batch at all")
            return
        r0, j0, first = real[0]
        want = _signature(first)
        for r, micros in enumerate(ranks):
            for j, mb in enumerate(micros):
                got = _signature(mb)
                missing = sorted(set(want) - set(got))
                wrong = sorted(k for k in set(want) & set(got) if got[k] != want[k])
                # extra fields (placeholders a trainer fills on padding only) harm nothing
                if missing or wrong:
                    kind = "padding micro-batch" if _is_padding(mb) else "micro-batch"
                    what = [f"missing {missing}" if missing else "",
                            ("dtype/dims/trailing shape differ: " + ", ".join(
                                f"{k} {got[k][0]} {got[k][2]} vs {want[k][0]} {want[k][2]}"
                                for k in wrong)) if wrong else ""]
                    t.fail(f"{label}: rank {r} {kind} {j} vs the real micro-batch {j0} of rank "
                           f"{r0}: " + "; ".join(w for w in what if w))
    return layouts(env, "make_microbatches:padding-complete", body).result(
        "layouts give padding micro-batches like the real ones")


# ---- train_step ------------------------------------------------------------------------------

def _train_runs(env: StageEnv):
    """(batch, unchanged ok, first output, first output's values, second output) or a reason
    string why train_step cannot be checked; computed once per environment."""
    cached = getattr(env, "_train_runs", None)
    if cached is not None:
        return cached
    if env.model_path is None:
        env._train_runs = "no model snapshot given (run through run_target)"
        return env._train_runs
    cfg = builtin.config()
    ok, why = supports(env.adapter, cfg)
    if not ok:
        env._train_runs = f"the built-in configuration is not supported: {why}"
        return env._train_runs
    batch = builtin.rollout(env.model_path)
    before = batch_state(batch)
    kw = dict(model_path=str(env.model_path), ref_model_path=None, batch=batch, config=cfg,
              device="cpu")
    try:
        first = env.adapter.train_step(steps=1, **kw)
        values = [metric_floats(m, "train_step") for m in first.metrics]
        second = env.adapter.train_step(steps=2, **kw)
    except UnsupportedFeature:   # the adapter says the release cannot: each check unsupported
        raise
    except (Exception, SystemExit) as e:  # the adapter's failure on a valid batch is the finding
        env._train_runs = AdapterRaised("train_step", e)
        return env._train_runs
    env._train_runs = (unchanged_since(batch, before), first, values, second)
    return env._train_runs


def _not_run(check: str, env: StageEnv, runs) -> CheckResult | None:
    """The result when train_step could not be run (n/a) or raised (fail)."""
    if isinstance(runs, str):
        return CheckResult(check, env.name, NA, runs)
    if isinstance(runs, AdapterRaised):
        t = env.tally(check)
        t.fail(f"on the built-in rollout: {runs}")
        return t.result("")
    return None


@stage_check("train_step", "metrics-are-copies", "no-mutation")
def train_metrics_copies(env: StageEnv) -> CheckResult:
    """The metrics a train_step call returned keep their values after the adapter runs again,
    and a two-step run's first-step metrics equal a one-step run's: no returned metric is a view
    of state that later steps or calls update in place (e.g. a loss divided in place by the
    number of micro-batches after it was reported). Assumes train_step is deterministic."""
    t = env.tally("train_step:metrics-are-copies")
    runs = _train_runs(env)
    if (skip := _not_run(t.check, env, runs)) is not None:
        return skip
    _, first, values, second = runs
    for name, value in values[0].items():
        t.compare(f"{name} returned by a 1-step call, after a 2-step call",
                  float(first.metrics[0][name]), value)
    later = metric_floats(second.metrics[0], "train_step") if second.metrics else {}
    for name, value in values[0].items():
        if name.startswith("timing/"):
            continue
        if name not in later:
            t.fail(f"{name} logged at step 0 of a 1-step run but not of a 2-step run")
        else:
            t.compare(f"{name} at step 0 of a 2-step run vs a 1-step run", later[name], value)
    return t.result("metric values stable")


@stage_check("train_step", "no-input-mutation", "no-mutation")
def train_no_mutation(env: StageEnv) -> CheckResult:
    """The batch handed to train_step is bit-identical afterwards (values and version
    counters of every tensor)."""
    runs = _train_runs(env)
    name = "train_step:no-input-mutation"
    if (skip := _not_run(name, env, runs)) is not None:
        return skip
    unchanged = runs[0]
    t = env.tally(name)
    t.checked += 1
    if not unchanged:
        t.fail("train_step modified the batch it was given in place")
    return t.result("train_step calls left their input batch unchanged")
