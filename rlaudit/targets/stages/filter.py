"""Stage checks of ``filter_groups``: DAPO's dynamic sampling (registered into
checks.STAGE_CHECKS).

What is checked is what verl's DAPO recipe does (recipe/dapo/dapo_ray_trainer.py, ``fit``): per
``uid``, collect the filter metric of the group's rows; keep every row of a group whose metric has
a non-zero standard deviation, and the row of a one-row group; drop the rest
(``new_batch = new_batch[kept_traj_idxs]``). rlaudit's reference is
:func:`rlaudit.algo.dapo.filter_groups`, which decides "std > 0" exactly as "not all equal".

The two agree whenever a group of equal values has an exactly computed mean. verl takes
``np.std``, and ``np.std([0.1] * 3)`` is 1.4e-17 > 0 (the mean of three 0.1 rounds), so verl keeps
such a group. The inputs here therefore use **dyadic** metric values (multiples of 1/8, exact in
every float format down to bfloat16, and so are their sums and means): a trainer deciding
"std > 0" either way passes; one grouping by position, dropping singletons or keeping groups
without spread does not.

The kept rows are recognised by their content (every input row has a distinct first prompt token,
as in the micro-batching checks), so the order a trainer returns them in does not matter; each
field of a kept row is compared with the same row of the input, on the row's valid positions only
(values under ``response_mask`` False may be anything). A field re-taken from the unfiltered
batch after filtering (``kept["scores"] = batch["scores"][:n]``) shows up as a kept row whose
field belongs to another row.

The batch is handed over as a trainer holds it at the filter: with the filter metric as a column
(:data:`METRIC_FIELD`; verl's recipe stores it in the batch under the metric's name,
``new_batch.non_tensor_batch[metric_name]``, before ``new_batch[kept_traj_idxs]``), and also as the
``metric`` argument. A trainer that filters on the metric, then re-takes the column from the
unfiltered batch (to log it, or to build the reward from it) returns a kept batch whose metric
column belongs to other rows: rows-aligned compares it like every other field.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import torch

from rlaudit.algo.dapo import filter_groups
from rlaudit.data.batch import Kind, RolloutBatch
from rlaudit.targets.contract.guard import AdapterRaised
from rlaudit.targets.inputs.cases import response_mask
from rlaudit.targets.stages.common import row_key, same_mask
from rlaudit.targets.stages.registry import StageEnv, Tally, attempt, stage_check
from rlaudit.verdict.result import CheckResult

#: fields that identify a row (a kept batch must carry them, in rlaudit names)
KEY_FIELDS = ("prompt_ids", "prompt_lengths", "response_ids", "response_lengths",
              "response_mask")
#: first prompt token of row i is FIRST_TOKEN + i: rows stay recognisable after filtering
FIRST_TOKEN = 1000
#: metric values are multiples of this (dyadic: exact sums and means, see the module docstring)
METRIC_STEP = 0.125
TOPK = 3
#: the batch column holding the filter metric (verl's DAPO recipe: the penalised sequence reward,
#: ``algorithm.filter_groups.metric: seq_final_reward``, stored under its name)
METRIC_FIELD = "seq_final_reward"


@dataclass(frozen=True)
class FilterInput:
    """One input of the filter checks: the batch and its ``[B]`` float64 filter metric."""

    name: str
    batch: RolloutBatch
    metric: torch.Tensor


def recognisable_batch(*, group_of_row: list[int], uids: list[int], prompt_lengths: list[int],
                       response_lengths: list[int], mask: torch.Tensor, prompt_width: int,
                       seed: int, garbage: bool = True) -> RolloutBatch:
    """A batch whose rows can be recognised by content (row i's first prompt token is
    ``FIRST_TOKEN + i``) with optional fields of every kind: ``scores`` (sequence),
    ``rollout_log_probs``, ``old_log_probs``, ``advantages`` (per token), ``teacher_topk_ids``
    (``[B, R, K]`` ints) and ``loss_weights`` (a float32 per-token field rlaudit does not know).
    ``mask`` ``[B, R]`` is the response mask (False past each length, possibly inside).
    With ``garbage``, float per-token fields hold finite values up to 50 in magnitude where the
    mask is False (a filter must carry them, nobody may read them)."""
    g = torch.Generator().manual_seed(seed)
    b, width = mask.shape
    prompt_ids = torch.randint(0, 50, (b, prompt_width), generator=g)
    prompt_ids[:, 0] = FIRST_TOKEN + torch.arange(b)
    lens = torch.tensor(response_lengths, dtype=torch.int64)
    in_resp = torch.arange(width).unsqueeze(0) < lens.unsqueeze(1)
    if bool((mask & ~in_resp).any()):
        raise ValueError("mask True past a response length")

    def per_token(low, high, dtype=torch.float64):
        v = low + (high - low) * torch.rand(b, width, generator=g, dtype=torch.float64)
        noise = (2 * torch.rand(b, width, generator=g, dtype=torch.float64) - 1) * 50.0
        return torch.where(mask | (not garbage), v, noise).to(dtype)

    tensors = {
        "prompt_ids": prompt_ids,
        "prompt_lengths": torch.tensor(prompt_lengths, dtype=torch.int64),
        "response_ids": torch.where(in_resp, torch.randint(0, 50, (b, width), generator=g), 0),
        "response_lengths": lens, "response_mask": mask.clone(),
        "uid": torch.tensor(uids, dtype=torch.int64)[torch.tensor(group_of_row,
                                                                  dtype=torch.int64)],
        "scores": torch.randint(0, 9, (b,), generator=g).double() * METRIC_STEP,
        "rollout_log_probs": per_token(-4.0, -0.01),
        "old_log_probs": per_token(-4.0, -0.01),
        "advantages": per_token(-2.0, 2.0),
        "teacher_topk_ids": torch.randint(0, 50, (b, width, TOPK), generator=g),
        "loss_weights": per_token(0.0, 1.0, torch.float32),
    }
    return RolloutBatch.from_tensors(tensors, kinds={"loss_weights": Kind.TOKEN},
                                     source="rlaudit.targets.stages.filter")


def _input(name: str, groups: list[list[float]], uids: list[int], lengths: list[int],
           width: int, *, holes: dict[int, list[int]] | None = None,
           all_masked: tuple[int, ...] = (), seed: int = 0) -> FilterInput:
    """Rows of ``groups`` (group g's metric values, uid ``uids[g]``) in a fixed shuffled order,
    so no group is contiguous; row i (after shuffling) has response length ``lengths[i]``."""
    g = torch.Generator().manual_seed(seed)
    flat = [(gi, m) for gi, vals in enumerate(groups) for m in vals]
    order = torch.randperm(len(flat), generator=g).tolist()
    flat = [flat[i] for i in order]
    mask = response_mask(lengths, width, holes, all_masked)
    prompt_lengths = torch.randint(1, 5, (len(flat),), generator=g).tolist()
    batch = recognisable_batch(group_of_row=[gi for gi, _ in flat], uids=uids,
                               prompt_lengths=prompt_lengths, response_lengths=lengths,
                               mask=mask, prompt_width=4, seed=seed)
    return FilterInput(name, batch, torch.tensor([m for _, m in flat], dtype=torch.float64))


def default_filter_inputs() -> list[FilterInput]:
    """Groups with and without spread, singletons (kept although their std is 0), int64 uids
    that are negative or beyond 2^32, ragged lengths (0 and the full width), masked holes, an
    all-masked row; a batch where every group is kept and one where none is."""
    return [
        _input("mixed", [[0.0, 1.0, 0.5, 1.0], [0.75] * 3, [0.25], [0.0, 0.125], [1.0, 1.0],
                         [0.5]],
               [10**12, -5, 7, 2**40 + 3, 0, 99], width=6,
               lengths=[6, 0, 1, 5, 6, 3, 6, 2, 6, 4, 3, 2, 1], holes={0: [2, 3], 4: [5]},
               all_masked=(8,), seed=1),
        _input("all-kept", [[0.0, 1.0], [0.5, 0.25, 0.5], [0.75]], [3, 1, 2], width=4,
               lengths=[4, 2, 1, 3, 4, 0], seed=2),
        _input("none-kept", [[0.5, 0.5], [1.0, 1.0, 1.0]], [4, 8], width=3,
               lengths=[3, 1, 2, 3, 2], seed=4),
    ]


# ---- reading the adapter's kept batch -----------------------------------------------------------

def held_batch(inp: FilterInput) -> RolloutBatch:
    """``inp``'s batch as a trainer holds it at the filter: its fields plus the ``[B]`` filter
    metric as the sequence column :data:`METRIC_FIELD`."""
    return inp.batch.with_fields({METRIC_FIELD: Kind.SEQ},
                                 **{METRIC_FIELD: inp.metric.clone()})


def _as_dict(out) -> dict[str, torch.Tensor]:
    if isinstance(out, RolloutBatch):
        out = dict(out.tensors)
    elif isinstance(out, Mapping):
        out = {k: v for k, v in out.items() if isinstance(v, torch.Tensor)}
    else:
        raise AdapterRaised("filter_groups", TypeError(
            f"expected the kept rows as a RolloutBatch or a dict of tensors, got "
            f"{type(out).__name__}"))
    missing = [k for k in KEY_FIELDS if k not in out]
    if missing:
        raise AdapterRaised("filter_groups", TypeError(
            f"the kept batch lacks {missing} (rlaudit names): its rows cannot be recognised"))
    rows = out["response_mask"].shape[0]
    bad = [k for k, v in out.items() if v.dim() == 0 or v.shape[0] != rows]
    if bad:
        raise AdapterRaised("filter_groups", TypeError(
            f"fields {bad} do not have {rows} rows like response_mask"))
    return out


def _kept(env: StageEnv, inp: FilterInput) -> tuple[dict[str, torch.Tensor], list[int | None]]:
    """The adapter's kept batch and, per kept row, the input row it is (None: not an input
    row)."""
    out, _ = env.call("filter_groups", label=inp.name, batch=held_batch(inp), metric=inp.metric)
    out = _as_dict(out)
    index = {row_key(inp.batch.tensors, j): j for j in range(len(inp.batch))}
    return out, [index.get(row_key(out, i)) for i in range(out["response_mask"].shape[0])]


def _group(inp: FilterInput, uid: int) -> str:
    rows = (inp.batch["uid"] == uid).nonzero().flatten()
    vals = [float(inp.metric[r]) for r in rows]
    return f"uid={uid} ({len(vals)} row(s), metric {vals})"


# ---- the checks ----------------------------------------------------------------------------------

def _inputs(env: StageEnv) -> list[FilterInput]:
    return env.setting("filter_inputs", None) or default_filter_inputs()


@stage_check("filter_groups", "kept-groups", "parity")
def kept_groups(env: StageEnv) -> CheckResult:
    """The kept rows are exactly the rows of the groups (by ``uid``, rows not contiguous) whose
    metric is not constant, plus the rows of one-row groups; each exactly once, in any order."""
    t = env.tally("filter_groups:kept-groups")
    for inp in _inputs(env):
        def one(inp=inp):
            out, rows = _kept(env, inp)
            t.checked += 1
            want = set(filter_groups(inp.batch["uid"], inp.metric).nonzero().flatten().tolist())
            foreign = [i for i, j in enumerate(rows) if j is None]
            if foreign:
                t.fail(f"{inp.name}: kept row(s) {foreign[:4]} are not rows of the batch (their "
                       f"prompt/response tokens match no input row)")
            seen = [j for j in rows if j is not None]
            twice = sorted({j for j in seen if seen.count(j) > 1})
            if twice:
                t.fail(f"{inp.name}: input row(s) {twice[:4]} kept more than once")
            uid = inp.batch["uid"]
            for u in sorted({int(uid[j]) for j in set(seen) - want}):
                t.fail(f"{inp.name}: kept group {_group(inp, u)}, whose metric has no spread")
            for u in sorted({int(uid[j]) for j in want - set(seen)}):
                what = "the single row of" if int((uid == u).sum()) == 1 else "rows of"
                t.fail(f"{inp.name}: dropped {what} group {_group(inp, u)}")
        attempt(t, inp.name, one)
    return t.result("inputs keep exactly the groups with spread and the singletons")


def _compare_row(t: Tally, what: str, got: torch.Tensor, want: torch.Tensor,
                 valid: torch.Tensor | None) -> None:
    """Row ``got`` (a kept row's field) vs ``want`` (the input row's) on ``valid`` positions of
    dim 0 (None: everywhere); the kept batch may be narrower or wider than the input."""
    if valid is not None:
        cols = valid.nonzero().flatten()
        if len(cols) and int(cols.max()) >= got.shape[0]:
            t.fail(f"{what}: the kept row is {got.shape[0]} wide, the row has valid positions up "
                   f"to {int(cols.max())}")
            return
        got, want = got[cols], want[cols]
    if got.shape != want.shape:
        t.fail(f"{what}: shape {tuple(got.shape)}, expected {tuple(want.shape)}")
    elif want.is_floating_point():
        t.compare(what, got, want)
    else:
        t.checked += 1
        if not torch.equal(got.to(want.dtype).cpu(), want):
            t.fail(f"{what}: {got.tolist()} is not the row's {want.tolist()}")


@stage_check("filter_groups", "rows-aligned", "metamorphic")
def rows_aligned(env: StageEnv) -> CheckResult:
    """Every field of every kept row equals that row's field in the input (sequence fields;
    per-token fields on the row's valid tokens, values under the mask are not compared; prompt
    fields on the prompt), and its response mask is unchanged: no field is re-taken from the
    unfiltered batch or shifted by the dropped rows, the filter metric's column
    (:data:`METRIC_FIELD`) included. Fields a trainer does not carry are not compared (a kept
    batch needs only the fields its trainer uses, plus the row keys)."""
    t = env.tally("filter_groups:rows-aligned")
    not_carried: set[str] = set()
    for inp in _inputs(env):
        def one(inp=inp):
            out, rows = _kept(env, inp)
            src = held_batch(inp)
            not_carried.update(set(src.keys()) - set(out))
            for i, j in enumerate(rows):
                if j is None:
                    continue            # kept-groups reports rows that are not input rows
                mask = src.mask[j]
                t.checked += 1
                if not same_mask(out["response_mask"][i].bool(), mask):
                    t.fail(f"{inp.name}: kept row {i} (input row {j}): response_mask "
                           f"{out['response_mask'][i].int().tolist()} is not the row's "
                           f"{mask.int().tolist()}")
                for name, got in out.items():
                    if name in KEY_FIELDS or name not in src:
                        continue
                    kind = src.kinds[name]
                    valid = (mask if kind == Kind.TOKEN else
                             torch.arange(src.prompt_width) < src["prompt_lengths"][j]
                             if kind == Kind.PROMPT else None)
                    _compare_row(t, f"{inp.name}: kept row {i} (input row {j}) {name}",
                                 got[i], src[name][j], valid)
        attempt(t, inp.name, one)
    note = f" (not carried, not compared: {', '.join(sorted(not_carried))})" if not_carried else ""
    return t.result(f"field comparisons of kept rows agree with their input rows{note}")
