"""Deterministic inputs for the stage checks: small batches that hit what trainers get wrong.

Every case is built from a fixed seed (no hypothesis inside a check run: a check must give the
same verdict every time it runs), float64, and covers: ragged response lengths (0, 1 and the
full width R), singleton groups, non-contiguous rows of a group with arbitrary int64 ``uid``
values, masked holes inside responses, a row whose mask is all False although it has tokens,
zero-variance groups (equal scores) and a one-row batch.

A :class:`Case` holds *clean* inputs: every float per-token field is 0 where ``response_mask`` is
False, so a stage that reads masked positions still computes the right value on them (parity
checks stay about the formula). :func:`with_garbage` gives the same case with finite garbage
under the mask for the masked-values checks. Garbage is bounded (:data:`GARBAGE_SCALE`) so that
``0 * garbage`` is 0: masking by multiplication is not flagged, only reading masked values into a
valid result is.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

#: magnitude of the values written under mask 0 (finite: exp(50) ~ 5e21 still fits in float64)
GARBAGE_SCALE = 50.0
#: log-ratios (log_prob - old_log_prob) cycled over tokens so every clip region is hit:
#: ratio ~ 0.30 (below 1 - low), 0.74, 0.90, 1.05, 1.22 / 1.246 / 1.27 (between 1 + 0.2 and
#: 1 + 0.28: decides whether clip_ratio_high is honoured), 1.35, and 4.48 (above the dual-clip
#: bound 3 for negative advantages)
LOG_RATIOS = (-1.2, -0.3, -0.1, 0.05, 0.2, 0.22, 0.24, 0.3, 1.5)

#: log-ratios ``ref_log_prob - log_prob`` past k3's value clamp at 10: k3 = e^d - d - 1 is 16.09
#: at d = 3 and 49.6 at d = 4 (the clamp acts from d ~ 2.9; below 0 only from d ~ -11), 2.05 and
#: 1.14 at -3 and -2. k1, k2 and abs stay within 8 in magnitude: inside the +-10 value clamp some
#: trainers put on every estimator (declared differences there), and inside k3's +-20
#: log-ratio guard against overflow, which no trainer reaches in practice
KL_CLAMP_LOG_RATIOS = (-3.0, -2.0, 3.0, 4.0)

#: per-token float fields of a case (all [B, R], float64)
FLOAT_FIELDS = ("token_level_rewards", "token_level_scores", "values", "old_log_probs",
                "log_probs", "ref_log_probs", "advantages")


@dataclass(frozen=True)
class Case:
    """One stage input. ``tensors`` maps FLOAT_FIELDS and ``response_mask`` [B, R] bool,
    ``uid`` [B] int64, ``response_lengths`` [B] int64 to tensors."""

    name: str
    tensors: dict

    def __getitem__(self, key: str) -> torch.Tensor:
        return self.tensors[key]

    @property
    def mask(self) -> torch.Tensor:
        return self.tensors["response_mask"]

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.mask.shape)

    def permuted(self, perm: torch.Tensor) -> "Case":
        """Rows reordered: new row i = old row ``perm[i]`` (every field moves with its row)."""
        return replace(self, name=f"{self.name}[permuted]",
                       tensors={k: v[perm].clone() for k, v in self.tensors.items()})

    def rows(self, idx: torch.Tensor) -> "Case":
        """The rows ``idx`` (a micro-batch of this case); width R is kept."""
        return replace(self, name=f"{self.name}[rows {idx.tolist()}]",
                       tensors={k: v[idx].clone() for k, v in self.tensors.items()})


def response_mask(lengths: list[int], width: int, holes: dict | None = None,
                  all_masked=()) -> torch.Tensor:
    """``[B, width]`` bool: row i valid on its first ``lengths[i]`` columns, then ``holes`` (row ->
    columns) and every column of the ``all_masked`` rows set False."""
    lens = torch.tensor(lengths, dtype=torch.int64)
    mask = torch.arange(width).unsqueeze(0) < lens.unsqueeze(1)
    for row, cols in (holes or {}).items():
        mask[row, cols] = False
    for row in all_masked:
        mask[row] = False
    return mask


def _build(name: str, group_sizes: list[int], uids: list[int], lengths: list[int], width: int,
           *, holes: dict[int, list[int]] | None = None, all_masked: tuple[int, ...] = (),
           equal_scores: bool = False, seed: int = 0) -> Case:
    """Rows of groups ``group_sizes`` (group g has uid ``uids[g]``), shuffled by a fixed
    permutation so no group is contiguous; row i has response length ``lengths[i]``; ``holes``
    masks extra positions inside responses; ``all_masked`` rows keep their length but no mask."""
    g = torch.Generator().manual_seed(seed)
    group_of_row = torch.tensor([gi for gi, n in enumerate(group_sizes) for _ in range(n)])
    b = int(group_of_row.numel())
    order = torch.randperm(b, generator=g)
    group_of_row = group_of_row[order]
    uid = torch.tensor(uids, dtype=torch.int64)[group_of_row]
    lens = torch.tensor(lengths, dtype=torch.int64)
    mask = response_mask(lengths, width, holes, all_masked)

    def rand(low, high):
        return low + (high - low) * torch.rand(b, width, generator=g, dtype=torch.float64)

    zero = torch.zeros((), dtype=torch.float64)
    scores = (torch.randint(0, 2, (b,), generator=g).double() if not equal_scores
              else torch.ones(b, dtype=torch.float64))
    # outcome reward on the last valid token plus small per-token shaping on every valid token,
    # so "sum of a row's rewards" and "reward at the last token" are different numbers -- except
    # in the equal-scores case, whose groups must have no spread at all (std exactly 0: a
    # trainer that sends such a group down its one-row path gives it its raw score, not 0)
    last = (torch.arange(width).unsqueeze(0) == (lens - 1).clamp(min=0).unsqueeze(1)) & mask
    shaping = rand(-0.1, 0.1)             # drawn in every case: later draws stay as they were
    if equal_scores:
        shaping = torch.zeros_like(shaping)
    rewards = torch.where(last, scores.unsqueeze(1), zero) + shaping
    old = rand(-4.0, -0.05)
    ratios = torch.tensor(LOG_RATIOS, dtype=torch.float64)
    idx = torch.arange(b * width).reshape(b, width) % len(LOG_RATIOS)
    log_probs = (old + ratios[idx]).clamp(max=-1e-3)
    tensors = {
        "token_level_rewards": rewards,
        "token_level_scores": torch.where(last, scores.unsqueeze(1), zero),
        "values": rand(-1.0, 1.0),
        "old_log_probs": old,
        "log_probs": log_probs,
        "ref_log_probs": (old + rand(-0.5, 0.5)).clamp(max=-1e-3),
        "advantages": rand(-2.0, 2.0),
    }
    tensors = {k: torch.where(mask, v, zero) for k, v in tensors.items()}
    tensors.update(response_mask=mask, uid=uid, response_lengths=lens)
    return Case(name, tensors)


def default_cases() -> list[Case]:
    """The cases every stage check runs on (B <= 10, R <= 7)."""
    return [
        # 7 and 2**40 + 7 are one number in int32: a trainer packing uids into 32 bits (for an
        # all-gather, say) merges their groups
        _build("ragged", [4, 1, 3, 2], [10**12, -5, 7, 2**40 + 7],
               lengths=[7, 0, 1, 5, 7, 3, 6, 2, 7, 4], width=7,
               holes={0: [2, 3], 4: [6]}, all_masked=(8,), seed=1),
        _build("uniform", [4, 4], [0, 1], lengths=[5] * 8, width=5, seed=2),
        _build("equal-scores", [3, 3], [3, 9], lengths=[4, 2, 4, 3, 4, 1], width=4,
               equal_scores=True, seed=3),
        _build("one-row", [1], [42], lengths=[3], width=4, seed=4),
    ]


def kl_clamp_case() -> Case:
    """kl_penalty's case past the KL clamps: two rows of width 4, the first holding every
    :data:`KL_CLAMP_LOG_RATIOS`, the second 4, -0.5, 0.5 (and -3 under its masked last
    position); ``log_prob = -0.5 - max(d, 0)``, ``ref = log_prob + d`` (both <= -0.5).
    The other fields are those of an ordinary case."""
    case = _build("kl-clamp", [2], [5], lengths=[4, 3], width=4, seed=5)
    d = torch.tensor([list(KL_CLAMP_LOG_RATIOS), [4.0, -0.5, 0.5, -3.0]], dtype=torch.float64)
    logp = -0.5 - d.clamp(min=0.0)
    zero = torch.zeros((), dtype=torch.float64)
    return replace(case, tensors={**case.tensors,
                                  "log_probs": torch.where(case.mask, logp, zero),
                                  "ref_log_probs": torch.where(case.mask, logp + d, zero)})


def with_garbage(case: Case, *, seed: int = 99, keep: tuple[str, ...] = ()) -> Case:
    """The same case with values in ``[-GARBAGE_SCALE, GARBAGE_SCALE]`` (log-probs: in
    ``[-GARBAGE_SCALE, 0]``) on every float field where ``response_mask`` is False, except the
    fields in ``keep`` (which a declared convention reads under the mask by design)."""
    g = torch.Generator().manual_seed(seed)
    out = dict(case.tensors)
    masked = ~case.mask
    for name in FLOAT_FIELDS:
        u = torch.rand(case.shape, generator=g, dtype=torch.float64)
        if name in keep:
            continue
        noise = (-u if "log_probs" in name else 2 * u - 1) * GARBAGE_SCALE
        out[name] = torch.where(masked, noise, case[name])
    return replace(case, name=f"{case.name}[garbage under mask]", tensors=out)


def fixed_permutation(n: int, seed: int = 1234) -> torch.Tensor:
    """A fixed permutation of ``range(n)``, never the identity when n > 1."""
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    return perm.roll(1) if torch.equal(perm, torch.arange(n)) and n > 1 else perm


def split_rows(n: int) -> list[torch.Tensor]:
    """Cut ``range(n)`` into up to three contiguous, non-empty pieces of unequal size
    (micro-batches for the global-normalisation split checks)."""
    if n <= 1:
        return [torch.arange(n)]
    cuts = sorted({1, max(2, (2 * n) // 3)} - {n})
    bounds = [0, *cuts, n]
    return [torch.arange(a, b) for a, b in zip(bounds, bounds[1:]) if b > a]


@dataclass(frozen=True)
class Draw:
    """One set of stage inputs beyond the fixed ones (a fuzz example, or a stage case it found):
    the math stages' cases and the StageEnv overrides."""

    cases: tuple[Case, ...] = ()
    overrides: dict = field(default_factory=dict)

    def describe(self) -> str:
        parts = [f"{k}={v}" for k, v in self.overrides.items()
                 if k not in ("microbatch_inputs", "filter_inputs")]
        for c in self.cases:
            parts.append(f"case B={c.shape[0]}, R={c.shape[1]}")
        for b in self.overrides.get("microbatch_inputs", ()):
            parts.append(f"batch B={len(b)}, P={b.prompt_width}, R={b.response_width}")
        for f in self.overrides.get("filter_inputs", ()):
            parts.append(f"batch B={len(f.batch)}")
        return "; ".join(parts)
