"""The shared update step's pieces, against hand-worked layouts and naive loops."""

from __future__ import annotations

import math
import random

import pytest
import torch

from rlaudit.algo.agg import Denominators
from rlaudit.config import load_config
from rlaudit.data.batch import RolloutBatch
from rlaudit.scenarios.invariants.naive import naive_agg
from rlaudit.update import forward as fwd
from rlaudit.update.actor import actor_loss
from rlaudit.update.context import TorchContext
from rlaudit.update.plan import plan_micro

PAD = 99


def _batch(prompts, responses, r_width, **fields):
    b = len(prompts)
    p_width = max(len(p) for p in prompts)
    pids = torch.full((b, p_width), PAD)
    rids = torch.full((b, r_width), PAD)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        pids[i, :len(p)] = torch.tensor(p)
        rids[i, :len(r)] = torch.tensor(r, dtype=torch.long) if r else rids[i, :0]
    rl = torch.tensor([len(r) for r in responses])
    mask = torch.arange(r_width)[None] < rl[:, None]
    return RolloutBatch.from_tensors(dict(prompt_ids=pids, prompt_lengths=torch.tensor(
        [len(p) for p in prompts]), response_ids=rids, response_lengths=rl, response_mask=mask,
        uid=torch.arange(b), **fields))


def test_build_inputs_hand_worked_layout():
    batch = _batch([[5, 6], [1]], [[7, 8, 9], [2]], r_width=3)
    inp = fwd.build_inputs(batch, pad_id=PAD)
    assert inp.input_ids.tolist() == [[5, 6, 7, 8, 9], [1, 2, PAD, PAD, PAD]]
    assert inp.attention_mask.tolist() == [[True] * 5, [True, True, False, False, False]]
    assert inp.position_ids.tolist() == [[0, 1, 2, 3, 4]] * 2
    assert inp.labels.tolist() == [[6, 7, 8, 9, 0], [2, PAD, PAD, PAD, 0]]
    # response token t of row i is predicted at position prompt_len - 1 + t
    assert inp.gather_index.tolist() == [[1, 2, 3], [0, 1, 2]]
    assert inp.valid.tolist() == [[True] * 3, [True, False, False]]
    per_pos = torch.arange(10, dtype=torch.float64).view(2, 5)
    assert fwd.response_gather(per_pos, inp).tolist() == [[1.0, 2.0, 3.0], [5.0, 0.0, 0.0]]
    # the label at each response position is the response token itself
    labels = fwd.response_gather(inp.labels, inp)
    assert labels[0].tolist() == [7, 8, 9] and labels[1, 0].item() == 2


def _random_batch(seed: int, b: int = 6, r: int = 5):
    rng = random.Random(seed)
    prompts = [[rng.randrange(50) for _ in range(rng.randint(1, 3))] for _ in range(b)]
    responses = [[rng.randrange(50) for _ in range(rng.randint(0, r))] for _ in range(b)]
    g = torch.Generator().manual_seed(seed)
    lp = -torch.rand(b, r, generator=g, dtype=torch.float64) * 3
    adv = torch.randn(b, r, generator=g, dtype=torch.float64)
    ent = torch.rand(b, r, generator=g, dtype=torch.float64) * 2
    batch = _batch(prompts, responses, r, old_log_probs=lp, advantages=adv)
    mask = batch.mask
    return batch, lp * mask, adv * mask, ent * mask


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean",
                                  "seq-mean-token-sum-norm"])
def test_actor_loss_contributions_sum_to_the_whole_batch(mode):
    batch, lp, adv, ent = _random_batch(3)
    cfg = load_config({"actor": {"loss_agg_mode": mode, "calculate_entropy": True,
                                 "entropy_coeff": 0.0}})
    denom = Denominators.of(batch.mask, norm_len=batch.response_width)
    total, entropy = 0.0, 0.0
    for rows in ([0, 1], [2], [3, 4, 5]):  # an uneven cut
        micro = batch.select(rows)
        loss, stats = actor_loss(micro, {"log_probs": lp[rows], "entropy": ent[rows]}, cfg=cfg,
                                 denom=denom)
        total += float(loss)
        entropy += float(stats["actor/entropy"])
    # on-policy (log_prob == old): vanilla PPO's per-token loss is -A
    assert total == pytest.approx(naive_agg(-adv, batch.mask, mode), abs=1e-12)
    assert entropy == pytest.approx(naive_agg(ent, batch.mask, mode), abs=1e-12)


def test_entropy_coefficient_semantics():
    """SEEDS.md §1: computed when either knob asks; in the loss only with a coefficient."""
    batch, lp, adv, ent = _random_batch(5)
    denom = Denominators.of(batch.mask)
    out = {"log_probs": lp, "entropy": ent}

    def run(**actor):
        return actor_loss(batch, out, cfg=load_config({"actor": actor}), denom=denom)

    base_loss, base = run(calculate_entropy=False, entropy_coeff=0.0)
    assert "actor/entropy" not in base
    loss0, s0 = run(calculate_entropy=True, entropy_coeff=0.0)
    assert "actor/entropy" in s0 and float(loss0) == float(base_loss)
    loss1, s1 = run(calculate_entropy=False, entropy_coeff=0.1)
    want_ent = naive_agg(ent, batch.mask, "token-mean")
    assert float(s1["actor/entropy"]) == pytest.approx(want_ent, abs=1e-12)
    assert float(loss1) == pytest.approx(float(base_loss) - 0.1 * want_ent, abs=1e-12)


def test_plan_micro_padding_and_global_denominators():
    batch, *_ = _random_batch(7, b=5)
    ctx = TorchContext(torch.nn.Linear(1, 1))
    plan = plan_micro(ctx, batch, micro_batch_size=2, use_dynamic_bsz=False, max_token_len=0,
                      norm_len=5.0, extra_padding=2)
    assert plan.num_real == 3 and len(plan.micros) == 5
    assert [len(m) for m in plan.micros[:3]] == [2, 2, 1]
    for pad in plan.micros[3:]:
        assert set(pad.keys()) == set(batch.keys()) and not pad.mask.any()
    valid_rows = sum(1 for i in range(len(batch)) if batch.mask[i].any())
    assert plan.denom.tokens == int(batch.mask.sum()) and plan.denom.seqs == valid_rows


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_microbatch_mean_metrics_are_each_micro_batch_local_value(mode):
    """trainer.metric_reduction = microbatch-mean (a target's convention): the loss is still the
    global contribution; the metrics' local values are the micro-batch's own aggregation (naive
    loops)."""
    batch, lp, adv, ent = _random_batch(11)
    cfg = load_config({"actor": {"loss_agg_mode": mode, "calculate_entropy": True,
                                 "entropy_coeff": 0.05}})
    denom = Denominators.of(batch.mask, norm_len=batch.response_width)
    total = 0.0
    for rows in ([0, 1], [2], [3, 4, 5]):
        micro = batch.select(rows)
        local = Denominators.of(micro.mask, norm_len=batch.response_width)
        out = {"log_probs": lp[rows], "entropy": ent[rows]}
        loss, stats = actor_loss(micro, out, cfg=cfg, denom=denom, stat_denom=local)
        ref_loss, _ = actor_loss(micro, out, cfg=cfg, denom=denom)
        assert float(loss) == float(ref_loss)            # the update is unchanged
        total += float(loss)
        if not micro.mask.any():
            continue
        pg = naive_agg(-adv[rows], micro.mask, mode)
        h = naive_agg(ent[rows], micro.mask, mode)
        assert float(stats["actor/pg_loss@local"]) == pytest.approx(pg, abs=1e-12)
        assert float(stats["actor/entropy@local"]) == pytest.approx(h, abs=1e-12)
        assert float(stats["actor/loss@local"]) == pytest.approx(pg - 0.05 * h, abs=1e-12)
        # the contributions are reported too, unchanged
        ref_stats = actor_loss(micro, out, cfg=cfg, denom=denom)[1]
        assert all(float(stats[k]) == float(v) for k, v in ref_stats.items())
    want = naive_agg(-adv, batch.mask, mode) - 0.05 * naive_agg(ent, batch.mask, mode)
    assert total == pytest.approx(want, abs=1e-12)


def test_metric_accumulator_microbatch_means_skip_padding():
    from rlaudit.update.stats import MetricAccumulator

    class OneRank:
        def all_reduce(self, t, op="sum"):
            return t
    acc = MetricAccumulator()
    s = lambda v: {"actor/pg_loss": torch.tensor(v, dtype=torch.float64)}
    acc.add_micro_means(OneRank(), [s(1.0), s(3.0), s(0.0)], real=2)   # the third is padding
    acc.add_step({"actor/grad_norm": 2.0})
    acc.add_micro_means(OneRank(), [s(8.0)], real=1)
    acc.add_step({"actor/grad_norm": 4.0})
    # (1 + 3 + 8) / 3 micro-batches; grad_norm per optimizer step: (2 + 4) / 2
    assert acc.mean() == {"actor/pg_loss": 4.0, "actor/grad_norm": 3.0}


@pytest.mark.parametrize("loss_mode", ["vanilla", "gspo"])
def test_kl_loss_weighted_by_the_ratio(loss_mode):
    """kl_loss_weight="ratio": on-policy the KL term's value is the unweighted one (ratio 1) but
    its gradient is not: with k3 each token's gradient becomes ratio * (logp - ref) (vanilla,
    worked by hand in tests/algo/test_kl.py) where unweighted it is 1 - e^(ref - logp). Off
    policy the value is the token-mean of ratio * k3, computed here from the formula."""
    batch, lp, adv, _ = _random_batch(11)
    g = torch.Generator().manual_seed(3)
    ref = lp - torch.rand(lp.shape, generator=g, dtype=torch.float64)
    batch = batch.with_fields(ref_log_probs=ref)
    mask = batch.mask
    denom = Denominators.of(mask)

    def config(weight):
        return load_config({"actor": {"use_kl_loss": True, "kl_loss_type": "low_var_kl",
                                      "kl_loss_coef": 1.0, "kl_loss_weight": weight,
                                      "loss_mode": loss_mode},
                            "algorithm": {"k3_clamp": "none"}})

    def run(weight, x):
        x = x.clone().requires_grad_(True)
        _, stats = actor_loss(batch, {"log_probs": x}, cfg=config(weight), denom=denom)
        stats["actor/kl_loss"].backward()
        return float(stats["actor/kl_loss"].detach()), x.grad

    on_none, g_none = run("none", lp)
    on_ratio, g_ratio = run("ratio", lp)
    assert on_ratio == pytest.approx(on_none, rel=1e-14)
    n = float(mask.sum())
    want_none = torch.where(mask, 1 - torch.exp(ref - lp), 0.0) / n
    assert torch.allclose(g_none, want_none, rtol=1e-12, atol=1e-15)
    k3 = torch.where(mask, torch.exp(ref - lp) - (ref - lp) - 1, 0.0)
    if loss_mode == "vanilla":      # d(ratio) = ratio d logp: k3 + 1 - e^(ref - logp) = logp - ref
        want = torch.where(mask, lp - ref, 0.0) / n
    else:   # the row's ratio moves with every token of the row by 1 / n_i: the row's mean k3
        row_mean = k3.sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1)
        want = torch.where(mask, row_mean + 1 - torch.exp(ref - lp), 0.0) / n
    assert torch.allclose(g_ratio, want, rtol=1e-12, atol=1e-15)
    assert not torch.allclose(g_ratio, g_none)
    # off policy: old log-probs 0.3 lower on every token -> ratio e^0.3 (token level) and the
    # same for every row's mean (sequence level): the value is e^0.3 times the unweighted
    shifted = batch.with_fields(old_log_probs=lp - 0.3)
    _, stats = actor_loss(shifted, {"log_probs": lp}, cfg=config("ratio"), denom=denom)
    want = float(k3.sum()) / n * math.exp(0.3)
    assert float(stats["actor/kl_loss"]) == pytest.approx(want, rel=1e-12)
