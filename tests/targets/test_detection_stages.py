"""Stage hooks see the batch as the trainer holds it, and stage messages name the cause: a
filter that re-takes its metric column unfiltered is red on ``filter_groups:rows-aligned`` (the
metric is a batch column now, not only an argument); ``agg_loss:global-split`` names micro-batch
widths that differ from the ``norm_len`` the loss was normalised by."""

from __future__ import annotations

import torch

import broken_adapters as broken
from examples.toy_trainer.adapter import ToyAdapter
from rlaudit.targets.contract.own_adapters import ReferenceAdapter
from rlaudit.targets.stages import run_stage_checks
from rlaudit.targets.stages.agg import width_note
from rlaudit.targets.stages.filter import METRIC_FIELD, default_filter_inputs, held_batch
from rlaudit.verdict.result import FAIL, PASS


def statuses(adapter, stages):
    return {c.invariant: c for c in run_stage_checks(adapter, stages=stages).checks}


def test_the_filter_receives_the_metric_as_a_column():
    inp = default_filter_inputs()[0]
    seen = {}

    class Spy(ReferenceAdapter):
        def filter_groups(self, *, batch, metric):
            seen["column"], seen["metric"] = batch[METRIC_FIELD].clone(), metric.clone()
            return super().filter_groups(batch=batch, metric=metric)

    statuses(Spy(), ["filter_groups"])
    # the first input's column row for row is its metric: the "mixed" input's groups, shuffled
    assert torch.equal(seen["column"], seen["metric"])
    assert sorted(held_batch(inp)[METRIC_FIELD].tolist()) == sorted(
        [0.0, 1.0, 0.5, 1.0, 0.75, 0.75, 0.75, 0.25, 0.0, 0.125, 1.0, 1.0, 0.5])


def test_a_metric_column_retaken_unfiltered_is_red():
    checks = statuses(broken.FilterRetakesMetric(), ["filter_groups"])
    c = checks["filter_groups:rows-aligned"]
    assert c.status == FAIL and METRIC_FIELD in c.message, c.message
    # which groups it keeps is right: only the alignment of the column is wrong
    assert checks["filter_groups:kept-groups"].status == PASS
    for adapter in (ToyAdapter(), ReferenceAdapter()):
        got = statuses(adapter, ["filter_groups"])
        assert all(x.status == PASS for x in got.values()), {k: x.message for k, x in got.items()}
        assert METRIC_FIELD not in got["filter_groups:rows-aligned"].message   # compared


def test_width_note_hand_worked():
    assert width_note([7, 7], 7.0) == ""
    note = width_note([7, 6, 6], 7.0)
    assert "[7, 6, 6]" in note and "norm_len 7" in note


def test_global_split_names_the_width_norm_len_mismatch():
    c = statuses(broken.NormLenFromWidth(), ["agg_loss"])["agg_loss:global-split"]
    assert c.status == FAIL
    assert "differ from the norm_len" in c.message and "seq-mean-token-sum-norm" in c.message
    ok = statuses(ReferenceAdapter(), ["agg_loss"])["agg_loss:global-split"]
    assert ok.status == PASS, ok.message
