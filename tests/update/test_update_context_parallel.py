"""The simulated CP group of the shared update step: with the load-balanced split, each rank's
partial gradient touches only its own tokens, and the group's sum is the gradient of the whole
loss for every aggregation mode and for GSPO's sequence-level ratio (checked against autograd
on the unsplit loss); values and metrics are the unsplit ones."""

from __future__ import annotations

import pytest
import torch

from rlaudit.algo.agg import Denominators
from rlaudit.config import load_config
from rlaudit.data.context_parallel import response_token_ranks
from rlaudit.update.actor import actor_loss
from rlaudit.update.context_parallel import split_loss

from test_update_pieces import _random_batch

CASES = [("vanilla", m) for m in ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean",
                                  "seq-mean-token-sum-norm")] + [("gspo", "seq-mean-token-mean")]


def _grad(loss_fn, batch, lp, ent):
    x = (lp + 0.3 * torch.sin(torch.arange(lp.numel(), dtype=lp.dtype)).view_as(lp)
         ).requires_grad_(True)     # off-policy: ratios != 1, so clipping and GSPO's mean matter
    loss, stats = loss_fn(batch, {"log_probs": x, "entropy": ent})
    (g,) = torch.autograd.grad(loss, x)
    return float(loss.detach()), {k: float(v.detach()) for k, v in stats.items()}, g


@pytest.mark.parametrize("loss_mode, mode", CASES)
@pytest.mark.parametrize("cp", [2, 3])
def test_cp_group_gradient_is_the_whole_gradient(loss_mode, mode, cp):
    batch, lp, _, ent = _random_batch(7, b=6, r=5)
    cfg = load_config({"actor": {"loss_agg_mode": mode, "loss_mode": loss_mode,
                                 "calculate_entropy": True, "entropy_coeff": 0.01}})
    denom = Denominators.of(batch.mask, norm_len=batch.response_width)

    def plain(micro, out):
        return actor_loss(micro, out, cfg=cfg, denom=denom)

    want_loss, want_stats, want_g = _grad(plain, batch, lp, ent)
    got_loss, got_stats, got_g = _grad(split_loss(plain, cp), batch, lp, ent)
    assert got_loss == pytest.approx(want_loss, rel=1e-12, abs=1e-15)
    assert got_stats == pytest.approx(want_stats, rel=1e-12, abs=1e-15)
    assert torch.allclose(got_g, want_g, rtol=1e-12, atol=1e-15)
    # the split is real: each simulated rank alone yields only its own tokens' gradient
    ranks = response_token_ranks(batch["prompt_lengths"], batch["response_lengths"],
                                 batch.response_width, cp)
    for r in range(cp):
        def one_rank(micro, out, r=r):
            own = {k: torch.where(ranks == r, v, v.detach()) for k, v in out.items()}
            return plain(micro, own)
        _, _, g = _grad(one_rank, batch, lp, ent)
        assert torch.equal(g == 0, (ranks != r) | (want_g == 0))


def test_cp_one_is_the_loss_itself_and_a_wrong_reduction_differs():
    cfg = load_config({})
    batch, lp, _, ent = _random_batch(2)
    denom = Denominators.of(batch.mask)

    def plain(micro, out):
        return actor_loss(micro, out, cfg=cfg, denom=denom)

    assert split_loss(plain, 1) is plain
    _, _, want = _grad(plain, batch, lp, ent)

    def summed_values(micro, out):      # a CP group that also sums the full values: cp x
        losses = [split_loss(plain, 2)(micro, out)[0] for _ in range(2)]
        return losses[0] + losses[1], {}

    _, _, got = _grad(summed_values, batch, lp, ent)
    assert torch.allclose(got, 2 * want) and not torch.allclose(got, want)
