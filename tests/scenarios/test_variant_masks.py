"""Invariants read each variant's per-token tensors under that variant's own mask (issue #12,
item 1): a permuted or widened variant has rows and widths of its own, and a correct trainer may
leave any value (here -1) where its mask is False."""

from __future__ import annotations

import torch

from rlaudit.backends.base import VariantRun
from rlaudit.config import Config
from rlaudit.data.batch import RolloutBatch
from rlaudit.scenarios.invariants import INVARIANTS, CheckContext
from rlaudit.scenarios.invariants.base import base_variant
from rlaudit.verdict.result import FAIL, PASS
from rlaudit.scenarios.spec import Scenario

ROWS, P, R = 6, 3, 5


def _batch() -> RolloutBatch:
    """Rows of different response lengths, so permuting rows moves mask positions."""
    g = torch.Generator().manual_seed(0)
    rl = torch.tensor([5, 1, 3, 0, 4, 2])
    return RolloutBatch.from_tensors({
        "prompt_ids": torch.randint(0, 50, (ROWS, P), generator=g),
        "prompt_lengths": torch.tensor([3, 2, 3, 1, 2, 3]),
        "response_ids": torch.randint(0, 50, (ROWS, R), generator=g),
        "response_lengths": rl,
        "response_mask": torch.arange(R).unsqueeze(0) < rl.unsqueeze(1),
        "uid": torch.tensor([0, 0, 1, 1, 2, 2]),
        "scores": torch.rand(ROWS, generator=g, dtype=torch.float64),
    }, source="test")


def _scenario() -> Scenario:
    return Scenario(name="masks", path=None, description="", model=None, rollout=None,
                    config=Config(), backends={"target": {}}, steps=1,
                    invariants=["sanity-bounds", "row-permutation", "padding-appended"])


def _context(entropy_under_mask: float) -> CheckContext:
    """Runs of one backend for the baseline and the permuted and widened variants: per-token
    entropy 0.5 on each variant's valid tokens, ``entropy_under_mask`` elsewhere."""
    scn, batch = _scenario(), _batch()
    variants = [base_variant(scn, batch, "base")]
    for name in ("row-permutation", "padding-appended"):
        variants += INVARIANTS.get(name).variants(scn, batch)
    runs = {}
    for v in variants:
        m = v.batch.mask
        ent = torch.where(m, 0.5, entropy_under_mask).double()
        runs[v.name] = VariantRun(name=v.name, steps=[{"actor/entropy": 0.5}],
                                  tokens={"probe_entropy": ent})
    return CheckContext(scenario=scn, batch=batch, runs={"target": runs}, variants=variants)


def test_permuted_and_widened_variants_are_read_under_their_own_mask():
    ctx = _context(entropy_under_mask=-1.0)
    # the permuted variant's mask differs from the baseline's: the old check read -1 under it
    perm = ctx.variant("permutation").batch.mask
    assert not torch.equal(perm, ctx.batch.mask)
    [res] = INVARIANTS.get("sanity-bounds").check(ctx)
    assert res.status == PASS, res.message


def test_negative_entropy_on_a_valid_token_of_a_variant_is_still_caught():
    ctx = _context(entropy_under_mask=0.0)
    run = ctx.runs["target"]["padding:columns"]
    wide = ctx.mask("padding:columns")
    row, col = [int(i) for i in wide.nonzero()[-1]]
    run.tokens["probe_entropy"][row, col] = -1.0
    [res] = INVARIANTS.get("sanity-bounds").check(ctx)
    assert res.status == FAIL and "padding:columns" in res.message and "< 0" in res.message
