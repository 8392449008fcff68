"""The invariants that recompute a logged metric from per-token tensors (entropy-logged-when-coeff-
zero, on-policy-identities, config-effect) honour how a backend reduces it over micro-batches
(``trainer.metric_mode``) and the declared ``seq_count`` convention
(rlaudit/scenarios/invariants/logged.py). Hand-worked numbers, then the reference backend run
under a TRL-like declaration (loss a contribution, everything else micro-batch means, N_seq over
every row) against the built-in scenario."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from rlaudit.backends.base import VariantRun
from rlaudit.config import load_config
from rlaudit.scenarios.invariants.base import with_overrides
from rlaudit.scenarios.invariants.logged import logged_agg, microbatch_rows
from rlaudit.scenarios.invariants.naive import naive_agg
from rlaudit.verdict.result import FAIL, PASS
from rlaudit.targets import Difference
from rlaudit.targets.inputs import builtin
from rlaudit.targets.contract.own_adapters import ReferenceAdapter
from rlaudit.targets.run.runner import run_target_scenario

T, F = True, False


# ---- hand-worked: N_seq over valid rows or every row ---------------------------------------------

def test_naive_agg_seq_count():
    # rows: [1, 3] both valid; [9, 9] none valid; [4, (0)] one valid. Valid rows: 2, all rows: 3
    x = torch.tensor([[1.0, 3.0], [9.0, 9.0], [4.0, 0.0]])
    m = torch.tensor([[T, T], [F, F], [T, F]])
    want = {  # mode: (valid-rows, all-rows)
        "seq-mean-token-mean": ((2 + 4) / 2, (2 + 4) / 3),
        "seq-mean-token-sum": ((4 + 4) / 2, (4 + 4) / 3),
        "seq-mean-token-sum-norm": (8 / (2 * 2), 8 / (3 * 2)),
        "token-mean": (8 / 3, 8 / 3),
    }
    for mode, (valid, every) in want.items():
        assert naive_agg(x, m, mode) == pytest.approx(valid), mode
        assert naive_agg(x, m, mode, seq_count="all-rows") == pytest.approx(every), mode
    assert naive_agg(x, torch.zeros_like(m), "seq-mean-token-mean", seq_count="all-rows") == 0.0


# ---- hand-worked: which rows each micro-batch held ----------------------------------------------

class _Batch:
    """The three things microbatch_rows reads from a RolloutBatch."""

    def __init__(self, mask, lengths):
        self.mask = torch.tensor(mask)
        self._lengths = torch.tensor(lengths)

    def __len__(self):
        return len(self.mask)

    def sequence_lengths(self):
        return self._lengths


def _cfg(**actor):
    return load_config({"actor": actor}, source="test")


def _desc(rows, tokens, padding=False):
    return {"rows": rows, "tokens": tokens, "padding": padding, "fields": {}}


def test_microbatch_rows_from_the_config_cut():
    batch = _Batch([[T, T], [T, F], [F, F], [T, T], [T, F]], [5, 4, 3, 6, 2])
    no_log = VariantRun(name="v")
    rows = microbatch_rows(no_log, _cfg(ppo_micro_batch_size_per_gpu=2), batch)
    assert [r.tolist() for r in rows] == [[0, 1], [2, 3], [4]]
    # token budget 9, rows in order: 5+4 | 3+6 | 2
    rows = microbatch_rows(no_log, _cfg(use_dynamic_bsz=True, ppo_max_token_len_per_gpu=9), batch)
    assert [r.tolist() for r in rows] == [[0, 1], [2, 3], [4]]


def test_microbatch_rows_from_the_micro_batch_log():
    batch = _Batch([[T, T], [T, F], [F, F], [T, T], [T, F], [F, F]], [5, 4, 3, 6, 2, 1])
    cfg = _cfg(ppo_micro_batch_size_per_gpu=2)
    # one rank: micro-batches of 1, 3 and 2 rows (3, 3 and 1 tokens), then a padding one
    one = VariantRun(name="v", micro_log=[[[[_desc(1, 2), _desc(3, 3), _desc(2, 1),
                                             _desc(1, 0, padding=True)]]]])
    assert [r.tolist() for r in microbatch_rows(one, cfg, batch)] == [[0], [1, 2, 3], [4, 5]]
    # two ranks (contiguous shards of 3 rows), the first optimizer step of each
    two = VariantRun(name="v", micro_log=[[[[_desc(2, 3), _desc(1, 0)]],
                                           [[_desc(3, 3)]]]])
    assert [r.tolist() for r in microbatch_rows(two, cfg, batch)] == [[0, 1], [2], [3, 4, 5]]
    # a log that does not fit the batch (a token count off): rows unknown
    bad = VariantRun(name="v", micro_log=[[[[_desc(1, 2), _desc(5, 5)]]]])
    assert microbatch_rows(bad, cfg, batch) is None


def test_logged_agg_contribution_vs_microbatch_mean():
    # micro-batch 0: rows 0-1, valid tokens 1, 3 (mean 2); micro-batch 1: rows 2-3, valid 2, 2, 8
    # (mean 4). Whole batch: 16 / 5 = 3.2; mean of the micro-batch means: 3
    x = torch.tensor([[1.0, 3.0], [5.0, 0.0], [2.0, 2.0], [8.0, 0.0]])
    m = torch.tensor([[T, T], [F, F], [T, T], [T, F]])
    micros = [torch.tensor([0, 1]), torch.tensor([2, 3])]
    cfg = _cfg(loss_agg_mode="token-mean")
    assert logged_agg("actor/entropy", x, m, cfg, micros) == pytest.approx(3.2)
    mean = with_overrides(cfg, **{"trainer.metric_reduction": "microbatch-mean",
                                  "trainer.metric_reduction_except": ["actor/loss"]})
    assert logged_agg("actor/entropy", x, m, mean, micros) == pytest.approx(3.0)
    assert logged_agg("actor/loss", x, m, mean, micros) == pytest.approx(3.2)
    assert logged_agg("actor/entropy", x, m, mean, None) is None
    # seq-mean-token-mean over every row: micro-batch 0 (2 + 0) / 2, micro-batch 1 (2 + 8) / 2
    rows = with_overrides(mean, **{"actor.loss_agg_mode": "seq-mean-token-mean",
                                   "actor.loss_seq_count": "all-rows"})
    assert logged_agg("actor/entropy", x, m, rows, micros) == pytest.approx((1 + 5) / 2)
    assert logged_agg("actor/loss", x, m, rows, micros) == pytest.approx((2 + 2 + 8) / 4)


# ---- run level: the reference under a TRL-like declaration ------------------------------------------

INVARIANTS = ["entropy-logged-when-coeff-zero", "on-policy-identities", "config-effect"]


class TRLLikeReference(ReferenceAdapter):
    """rlaudit's reference trainer declaring what TRL does: actor/loss and actor/pg_loss logged
    as contributions, the other loss-term metrics as micro-batch means, N_seq over every row."""

    name = "trl-like"
    metric_reduction = {"actor/loss": "contribution", "actor/pg_loss": "contribution",
                        "*": "microbatch-mean"}
    differences = (Difference("all-rows", reason="N_seq counts every row", link="https://x.org",
                              checks=("*",), convention={"seq_count": "all-rows"}),)


class LogsGlobalMeans(TRLLikeReference):
    """Declares micro-batch means but logs every metric over the whole mini-batch."""

    name = "global-means"

    def replay(self, request):
        plain = {"trainer.metric_reduction": "contribution", "trainer.metric_reduction_except": []}
        variants = [dataclasses.replace(v, config=with_overrides(v.config, **plain))
                    for v in request.variants]
        return super().replay(dataclasses.replace(request, variants=variants))


def _run(adapter, tiny_model, builtin_rollout, agg):
    ref = builtin.tiny_model_path(None, "llama")
    scn = builtin.scenario(tiny_model, INVARIANTS, ref_model_path=ref)
    scn = dataclasses.replace(scn, config=with_overrides(scn.config,
                                                         **{"actor.loss_agg_mode": agg}))
    res = run_target_scenario(adapter, scn, builtin_rollout, invariants=INVARIANTS)
    return {(c.backend, c.invariant): c for c in res.checks}


@pytest.mark.slow
def test_invariants_recompute_microbatch_means(tiny_model, builtin_rollout):
    # token-mean: micro-batches of 2 rows hold unequal token counts, so the mean of their
    # entropy means is not the batch's; seq-mean-token-mean: N_seq over every row counts the
    # built-in's empty response (in the loss, as a contribution, and in every micro-batch mean)
    for agg in ("token-mean", "seq-mean-token-mean"):
        got = _run(TRLLikeReference(), tiny_model, builtin_rollout, agg)
        for backend in ("trl-like", "reference"):
            for inv in INVARIANTS:
                c = got[(backend, inv)]
                assert c.status == PASS, (agg, backend, inv, c.message)
    # the recomputation is not vacuous: whole-batch values logged where micro-batch means are
    # declared are caught
    bad = _run(LogsGlobalMeans(), tiny_model, builtin_rollout, "token-mean")
    c = bad[("global-means", "entropy-logged-when-coeff-zero")]
    assert c.status == FAIL and "averaged over micro-batches" in c.message, c.message
    assert bad[("global-means", "on-policy-identities")].status == FAIL
    assert bad[("reference", "entropy-logged-when-coeff-zero")].status == PASS
