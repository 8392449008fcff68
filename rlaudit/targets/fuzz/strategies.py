"""Hypothesis strategies for the stage fuzzer (:mod:`rlaudit.targets.fuzz.stage_fuzz`): one stage
check's input and configuration per example.

A :class:`~rlaudit.targets.inputs.cases.Draw` is what a check runs on: ``cases`` (the math
stages' inputs, see :class:`~rlaudit.targets.inputs.cases.Case`) and ``overrides``
(:attr:`StageEnv.overrides`: the one
estimator / KL kind / loss mode / aggregation / clip setting / layout the example uses, and the
batches of the micro-batching and filter checks). Structure is drawn by Hypothesis and shrinks
(groups, sizes, uids, row order, lengths, masks, widths, DP size, token budget, names); float
values come from a torch generator seeded by a drawn integer, as in rlaudit/strategies.py.

The domain is the one where rlaudit's float64 reference is itself the right answer for every
correct trainer at its declared precision (zero false alarms):

- log-ratios ``log_prob - old_log_prob`` stay within :data:`EXTREME_LOG_RATIO` of 0 for the
  stage's declared precision. 12 for float64: inside the +-20 clamp verl and the reference apply
  before exp() (a numerical-safety convention on which correct trainers differ), with ratios up to
  e^12 ~ 1.6e5, far past every clip bound, while GSPO's unclipped terms (|A| <= 2) stay below
  2^24 so float rounding remains relative to the magnitude the tolerance scales with. float32: 4,
  bfloat16: 1.5 (the fixed cases' range): the tolerance of those precisions is scaled by the
  magnitude of the *result*, and a token-mean of log-ratios of both signs loses
  ~|log-ratio| * eps * sqrt(n) to cancellation.
- ``ref_log_prob - log_prob`` and ``ref_log_prob - old_log_prob`` stay in [-10, 2.5], where k3's
  value clamp (10, verl's) is inactive; every log-prob is < 0.
- no ratio (per token, or GSPO's per-row geometric mean) lies within 1e-4 of a clip bound any
  check uses (1 - low, 1 + high, c): there a float32 trainer may legitimately round to the
  other side, and clip-effect's "the loss must move" needs a margin.
- scores and reward shaping are dyadic (multiples of 1/4 and 1/64): a group's rewards are either
  exactly equal (GRPO std exactly 0 in every precision) or differ by >= 1/64, never by rounding
  noise that a float32 std would see as 0 and a float64 one would divide by.
- every batch has at least two valid tokens (whitening estimators take an unbiased variance);
  below float64, the values gae / reinforce_plus_plus(_baseline) whiten over the batch have
  max|x| <= 4 std(x) (:func:`well_conditioned`): whitening amplifies rounding by max|x| / std,
  by 1e4 when all values are equal (verl 0.9.1 in float32 otherwise misses rtol 2e-5 by 2x).
- DAPO filter metrics are dyadic (rlaudit/targets/stages/filter.py says why).

Numbers that appear in a problem's label (the clip setting, an estimator's gamma/lam) are the
fixed checks' own (``CLIP_SETTINGS``, ``ESTIMATOR_SETTINGS``), and a generated input is named
after the fixed case of its kind (:func:`case_kind`): declared differences are narrowed by
substrings of those labels (``cases=("gae gamma=0.9 lam=0.95 advantages on ragged",)``), so they
apply to generated inputs exactly as to the fixed ones. What varies is everything else: the
geometry, the values, which estimator / KL kind / loss mode / aggregation / clip setting / layout
an example runs, the KL coefficient.
"""

from __future__ import annotations

import functools

import torch
from hypothesis import assume
from hypothesis import strategies as st

from rlaudit.algo.advantages import ADV_ESTIMATORS, compute_advantages
from rlaudit.algo.agg import AGG_MODES
from rlaudit.algo.distill import DISTILL_LOSSES
from rlaudit.algo.kl import KL_ESTIMATORS
from rlaudit.algo.policy_loss import POLICY_LOSSES
from rlaudit.targets.contract.adapter import accepts, supported_names
from rlaudit.targets.inputs.cases import Case, Draw
from rlaudit.targets.stages.advantage import ESTIMATOR_SETTINGS
from rlaudit.targets.stages.filter import METRIC_STEP, FilterInput, recognisable_batch
from rlaudit.targets.stages.identity import CLIP_MOVES
from rlaudit.targets.stages.loss import CLIP_SETTINGS

#: largest |log_prob - old_log_prob| per declared stage precision (module docstring)
EXTREME_LOG_RATIO = {"float64": 12.0, "float32": 4.0, "bfloat16": 1.5}
#: the moderate regime (the fixed cases' range)
MODERATE_LOG_RATIO = 1.5
#: k3's value clamp (10) is inactive for ref - log_prob in this interval (k3(2.6) ~ 9.9)
K3_SAFE = (-10.0, 2.5)
#: relative distance kept between any ratio and a clip bound
BOUND_GAP = 1e-4
INT64 = (-2**63, 2**63 - 1)


# ---- geometry ------------------------------------------------------------------------------------

@st.composite
def geometry(draw, *, max_groups=4, max_group_size=4, max_width=8, rows=None):
    """(group_of_row, uids, lengths, width, mask): groups of 1..max_group_size rows in a drawn
    order (a group's rows are not contiguous), distinct int64 uids, response lengths 0..R, each
    row full, with masked holes, or all masked. ``rows``: exactly that many rows instead."""
    if rows is None:
        sizes = draw(_group_sizes(max_group_size, max_groups))
        group_of_row = draw(_permutations(tuple(g for g, n in enumerate(sizes)
                                                for _ in range(n))))
    else:
        n_groups = draw(st.integers(1, max(1, min(max_groups, rows))))
        group_of_row = [draw(st.integers(0, n_groups - 1)) for _ in range(rows)]
        n_groups = max(group_of_row) + 1
        sizes = [group_of_row.count(g) for g in range(n_groups)]
    uids = draw(_uids(len(sizes)))
    width = draw(st.integers(1, max_width))
    lengths = [draw(st.integers(0, width)) for _ in group_of_row]
    mask = torch.zeros(len(group_of_row), width, dtype=torch.bool)
    for i, n in enumerate(lengths):
        mode = draw(_ROW_MODES)
        if mode == "full":
            mask[i, :n] = True
        elif mode == "holes" and n:
            mask[i, :n] = torch.tensor(draw(_bools(n)))
    return list(group_of_row), uids, lengths, width, mask


# The strategies geometry() draws from, built once per shape: a fresh strategy object is
# validated and its properties computed again on every draw (a quarter of a stage fuzz's time);
# the same strategy built once draws exactly the same values.
_ROW_MODES = st.sampled_from(["full", "holes", "all-masked"])


@functools.lru_cache(maxsize=None)
def _group_sizes(max_group_size: int, max_groups: int):
    return st.lists(st.integers(1, max_group_size), min_size=1, max_size=max_groups)


@functools.lru_cache(maxsize=256)
def _permutations(items: tuple):
    return st.permutations(list(items))


@functools.lru_cache(maxsize=None)
def _uids(n: int):
    return st.lists(st.integers(*INT64), min_size=n, max_size=n, unique=True)


@functools.lru_cache(maxsize=None)
def _bools(n: int):
    return st.lists(st.booleans(), min_size=n, max_size=n)


# ---- math-stage cases ----------------------------------------------------------------------------

def _log_ratios(regime: str, shape, g, clip, bound: float) -> torch.Tensor:
    u = torch.rand(shape, generator=g, dtype=torch.float64)
    if regime == "extreme":
        return (2 * u - 1) * bound
    if regime == "moderate":
        return (2 * u - 1) * min(bound, MODERATE_LOG_RATIO)
    low, high, c = clip           # "clip-bounds": ratios just inside / outside every bound
    delta = 0.002 + 0.05 * torch.rand(shape, generator=g, dtype=torch.float64)
    mid = 1 + (low + high) / 2 if high > low else 1.0
    targets = torch.tensor([1 - low, 1 - low, mid, 1 + high, 1 + high, c, c, 1.0, 0.05],
                           dtype=torch.float64)
    sign = torch.tensor([-1, 1, 0, -1, 1, -1, 1, 0, 0], dtype=torch.float64)
    k = torch.randint(0, len(targets), shape, generator=g)
    ratio = (targets[k] * (1 + sign[k] * delta)).clamp_min(1e-6)
    return ratio.log().clamp(-bound, bound)


def clip_bounds() -> list[float]:
    """Every ratio bound a check uses: 1 - low, 1 + high and c of the clip settings of
    policy_loss:parity and of the moves of policy_loss:clip-effect."""
    settings = list(CLIP_SETTINGS) + [c for move in CLIP_MOVES for c in move[1:3]]
    return sorted({b for low, high, c in settings for b in (1 - low, 1 + high, c)})


def _away_from_bounds(lr: torch.Tensor, mask: torch.Tensor, clip) -> torch.Tensor:
    """Nudge log-ratios (per token, and per row for GSPO's geometric mean) whose ratio lies
    within BOUND_GAP of a clip bound (of ``clip`` or of any check, :func:`clip_bounds`) by
    2e-3."""
    low, high, c = clip
    bounds = torch.tensor(sorted({1 - low, 1 + high, c, *clip_bounds()}), dtype=torch.float64)
    for _ in range(3):
        near = ((lr.exp().unsqueeze(-1) / bounds - 1).abs() < BOUND_GAP).any(-1)
        n = mask.sum(-1).clamp(min=1)
        seq = (torch.where(mask, lr, 0.0).sum(-1) / n).exp()
        near_row = ((seq.unsqueeze(-1) / bounds - 1).abs() < BOUND_GAP).any(-1)
        if not bool(near.any()) and not bool(near_row.any()):
            break
        lr = lr + 2e-3 * (near | (near_row.unsqueeze(-1) & mask))
    return lr


@st.composite
def cases(draw, *, clip=(0.2, 0.28, 3.0), bound: float = EXTREME_LOG_RATIO["float64"]):
    """A :class:`Case` with drawn geometry, log-ratio regime and dyadic scores."""
    group_of_row, uids, lengths, width, mask = draw(geometry())
    assume(int(mask.sum()) >= 2)
    regime = draw(st.sampled_from(["moderate", "clip-bounds", "extreme"]))
    shaping = draw(st.booleans())
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    b = len(group_of_row)
    lens = torch.tensor(lengths, dtype=torch.int64)
    zero = torch.zeros((), dtype=torch.float64)
    scores = torch.randint(0, 5, (b,), generator=g).double() / 4
    last = (torch.arange(width).unsqueeze(0) == (lens - 1).clamp(min=0).unsqueeze(1)) & mask
    shaping_t = (torch.randint(-6, 7, (b, width), generator=g).double() / 64 if shaping
                 else torch.zeros(b, width, dtype=torch.float64))
    lr = _away_from_bounds(_log_ratios(regime, (b, width), g, clip, bound), mask, clip)
    u = torch.rand(b, width, generator=g, dtype=torch.float64)
    lo = torch.maximum(torch.full_like(lr, K3_SAFE[0]), lr + K3_SAFE[0]) + 0.1
    hi = torch.minimum(torch.full_like(lr, K3_SAFE[1]), lr + K3_SAFE[1]) - 0.1
    if regime == "moderate":            # ref within 0.5 of old, as in the fixed cases
        lo = torch.maximum(lo, torch.full_like(lr, -0.5))
        hi = torch.minimum(hi, torch.full_like(lr, 0.5))
    d_ref = lo + (hi - lo).clamp_min(0) * u          # ref - old
    old = -(lr.clamp_min(0) + d_ref.clamp_min(0) + 0.05
            + 3.95 * torch.rand(b, width, generator=g, dtype=torch.float64))

    def rand(low, high):
        return low + (high - low) * torch.rand(b, width, generator=g, dtype=torch.float64)

    tensors = {
        "token_level_rewards": torch.where(last, scores.unsqueeze(1), zero) + shaping_t,
        "token_level_scores": torch.where(last, scores.unsqueeze(1), zero),
        "values": rand(-1.0, 1.0), "old_log_probs": old, "log_probs": old + lr,
        "ref_log_probs": old + d_ref, "advantages": rand(-2.0, 2.0),
    }
    tensors = {k: torch.where(mask, v, zero) for k, v in tensors.items()}
    uid = torch.tensor(uids, dtype=torch.int64)[torch.tensor(group_of_row)]
    tensors.update(response_mask=mask, uid=uid, response_lengths=lens)
    return Case(case_kind(tensors), tensors)


def case_kind(t: dict) -> str:
    """The name of a generated input: the fixed case (rlaudit/targets/inputs/cases.py) whose edge
    features it has: ``one-row`` (B = 1), ``ragged`` (a row of length 0, a masked hole, an
    all-masked row or a one-row group), ``equal-scores`` (a group whose scores do not vary),
    else ``uniform``. Problem messages name the case ("... on ragged"), so a difference declared
    for a fixed case (``cases=("... on ragged",)``) covers generated inputs of the same kind,
    exactly as it covers the fixed one."""
    mask, lens, uid = t["response_mask"], t["response_lengths"], t["uid"]
    if len(uid) == 1:
        return "one-row"
    in_resp = torch.arange(mask.shape[1]).unsqueeze(0) < lens.unsqueeze(1)
    _, counts = torch.unique(uid, return_counts=True)
    if bool((lens == 0).any()) or bool((in_resp & ~mask).any()) or bool((counts == 1).any()):
        return "ragged"
    scores = t["token_level_scores"].sum(-1)
    for u in torch.unique(uid):
        s = scores[uid == u]
        if len(s) > 1 and bool((s == s[0]).all()):
            return "equal-scores"
    return "uniform"


# ---- per-stage draws -----------------------------------------------------------------------------

#: the name each registry's draws shrink to (rlaudit's config defaults)
DEFAULT_NAMES = {"advantage_estimators": "grpo", "kl_estimators": "k1", "loss_modes": "vanilla",
                 "loss_agg_modes": "token-mean", "distill_losses": "forward_kl_topk"}


def default_first(names: list[str], default: str, registry=None) -> list[str]:
    """``names`` with ``default`` (or an alias of it in ``registry``) first: Hypothesis shrinks
    towards it."""
    canon = getattr(registry, "canonical", None) or (lambda n: n)
    first = [n for n in names if canon(n) == canon(default)]
    return first + [n for n in names if n not in first]


def _names(adapter, attr, reference, key=None) -> list[str]:
    names = supported_names(adapter, attr, reference, key=key)
    return default_first(names, DEFAULT_NAMES[attr], reference)


#: batch whitening ``(x - mean) / sqrt(var + 1e-8)`` amplifies rounding by max|x| / std(x)
#: (and by 1e4 when var ~ 0): below float64, generated inputs keep max|x| <= this x std(x)
WHITEN_CONDITION = 4.0


def well_conditioned(est: str, setting: dict, case: Case) -> bool:
    """Whether the values ``est`` whitens over the batch (gae: advantages before whitening;
    reinforce_plus_plus: returns; reinforce_plus_plus_baseline: centred row scores) have a
    spread of at least 1/WHITEN_CONDITION of their magnitude, so that a float32 or bfloat16
    trainer's result is within its tolerance (rounding relative to the inputs, amplified by
    max|x| / std(x) in the whitening). Estimators that do not whiten: always True."""
    m = case.mask
    kw = dict(token_level_rewards=case["token_level_rewards"], response_mask=m, uid=case["uid"],
              values=case["values"], gamma=setting.get("gamma", 1.0), lam=setting.get("lam", 1.0))
    if est == "reinforce_plus_plus":
        x = compute_advantages(est, **kw)[1]
    elif est == "gae":
        x = compute_advantages(est, **kw)[1] - case["values"]
    elif est == "reinforce_plus_plus_baseline":
        rows = torch.where(m, case["token_level_rewards"], 0.0).sum(-1)
        _, inv, counts = torch.unique(case["uid"], return_inverse=True, return_counts=True)
        mean = torch.zeros(len(counts), dtype=rows.dtype).scatter_add(0, inv, rows) / counts
        centred = rows - torch.where(counts[inv] == 1, 0.0, mean[inv])
        x = centred.unsqueeze(1).expand_as(m)
    else:
        return True
    xv = x[m]
    return xv.numel() > 1 and float(xv.abs().max()) <= WHITEN_CONDITION * float(xv.std())


def _clip():
    """The checks' own clip settings: a setting is part of every problem's label, and labels
    are what declared differences are narrowed by (see the module docstring)."""
    return st.sampled_from(list(CLIP_SETTINGS))


def _estimator_setting(est: str):
    """The checks' own settings of ``est`` (gamma, lam, std normalisation; labels, as clip)."""
    return st.sampled_from(ESTIMATOR_SETTINGS.get(est, [{}]))


def stage_draws(stage: str, adapter, precision: str, check: str = ""):
    """The strategy of Draws for ``stage`` (None: the stage is not fuzzed); ``check``: the check
    the draws are for (policy_loss:metrics-are-copies gets two inputs)."""
    bound = EXTREME_LOG_RATIO[precision]
    if stage == "compute_advantages":
        ests = _names(adapter, "advantage_estimators", ADV_ESTIMATORS)

        @st.composite
        def adv(draw):
            est = draw(st.sampled_from(ests))
            setting = dict(draw(_estimator_setting(est)))
            case = draw(cases(bound=bound))
            if precision != "float64":
                assume(well_conditioned(est, setting, case))
            return Draw((case,),
                        {"advantage_estimators": (est,), "estimator_settings": {est: [setting]}})
        return adv()
    if stage in ("apply_kl_in_reward", "kl_penalty"):
        kinds = _names(adapter, "kl_estimators", KL_ESTIMATORS)

        @st.composite
        def kl(draw):
            over = {"kl_estimators": (draw(st.sampled_from(kinds)),)}
            if stage == "apply_kl_in_reward":
                # 0: the penalty off, the KL still computed and stored (verl #6016's kind)
                over["kl_coef"] = draw(st.sampled_from([0.1, 0.001, 1.0, 0.0]))
            return Draw((draw(cases(bound=bound)),), over)
        return kl()
    if stage == "agg_loss":
        modes = _names(adapter, "loss_agg_modes", AGG_MODES)
        return st.builds(lambda m, c: Draw((c,), {"loss_agg_modes": (m,)}),
                         st.sampled_from(modes), cases(bound=bound))
    if stage == "policy_loss":
        runs = [(m, a) for m in _names(adapter, "loss_modes", POLICY_LOSSES)
                for a in _names(adapter, "loss_agg_modes", AGG_MODES, key=m)]

        @st.composite
        def pol(draw):
            mode, agg = draw(st.sampled_from(runs))
            clip = draw(_clip())
            # metrics-are-copies calls the adapter on a second input after the first
            n = 2 if check.endswith(":metrics-are-copies") else 1
            two = tuple(draw(cases(clip=clip, bound=bound)) for _ in range(n))
            return Draw(two, {"loss_modes": (mode,), "loss_agg_modes": (agg,),
                              "clip_settings": (clip,)})
        return pol()
    if stage == "distill_loss":
        names = _names(adapter, "distill_losses", DISTILL_LOSSES)
        return st.builds(lambda n, c: Draw((c,), {"distill_losses": (n,)}),
                         st.sampled_from(names), cases(bound=bound))
    if stage == "make_microbatches":
        return microbatch_draws(tokens=accepts(adapter.make_microbatches, "max_token_len"))
    if stage == "filter_groups":
        return filter_draws()
    return None


@st.composite
def microbatch_draws(draw, *, tokens: bool = True):
    """A recognisable batch of dp x (1..4) rows and one layout: dp 1..4, micro-batches by count
    (1..4 rows) or by a token budget (at least the padded width P + R)."""
    dp = draw(st.integers(1, 4))
    rows = dp * draw(st.integers(1, 4))
    group_of_row, uids, lengths, width, mask = draw(geometry(rows=rows, max_width=6))
    prompt_width = draw(st.integers(1, 5))
    # full-width prompts as often as shorter ones: rows long in their prompt are where a token
    # budget that counts only part of a row shows
    prompt_lengths = [draw(st.one_of(st.just(prompt_width), st.integers(1, prompt_width)))
                      for _ in range(rows)]
    batch = recognisable_batch(group_of_row=group_of_row, uids=uids,
                               prompt_lengths=prompt_lengths, response_lengths=lengths,
                               mask=mask, prompt_width=prompt_width,
                               seed=draw(st.integers(0, 2**31 - 1)))
    extra = draw(st.integers(0, 2))      # extra padding micro-batches (cutters that take it)
    if tokens and draw(st.booleans()):
        # at least the padded width P + R: verl asserts max_token_len >= the padded sequence
        # length (seqlen_balancing.prepare_dynamic_batch), a precondition, not a bug
        # up to twice that: a budget that fits whole shards never needs padding micro-batches;
        # half the draws exactly the padded width, the tightest budget, where a cutter counting
        # part of each row (the response only) overfills a micro-batch most often
        slack = draw(st.one_of(st.just(0), st.integers(1, prompt_width + width)))
        layout = (dp, None, prompt_width + width + slack, extra)
    else:
        layout = (dp, draw(st.integers(1, 4)), None, extra)
    return Draw((), {"microbatch_inputs": (batch,), "layouts": (layout,)})


@st.composite
def filter_draws(draw):
    """A recognisable batch with a dyadic DAPO filter metric: per group, equal values (no
    spread) or independent ones; singleton groups included."""
    group_of_row, uids, lengths, width, mask = draw(geometry(max_groups=5))
    n_groups = max(group_of_row) + 1
    equal = [draw(st.booleans()) for _ in range(n_groups)]
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    steps = int(round(1 / METRIC_STEP))
    group_value = torch.randint(0, steps + 1, (n_groups,), generator=g)
    row_value = torch.randint(0, steps + 1, (len(group_of_row),), generator=g)
    metric = torch.tensor([float(group_value[gi] if equal[gi] else row_value[i]) * METRIC_STEP
                           for i, gi in enumerate(group_of_row)], dtype=torch.float64)
    prompt_lengths = [draw(st.integers(1, 4)) for _ in group_of_row]
    batch = recognisable_batch(group_of_row=group_of_row, uids=uids,
                               prompt_lengths=prompt_lengths, response_lengths=lengths,
                               mask=mask, prompt_width=4, seed=draw(st.integers(0, 2**31 - 1)))
    return Draw((), {"filter_inputs": (FilterInput("fuzz", batch, metric),)})


__all__ = ["Draw", "EXTREME_LOG_RATIO", "cases", "filter_draws", "geometry",
           "microbatch_draws", "stage_draws"]
