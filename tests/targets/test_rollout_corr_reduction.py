"""rollout-correction honours a declared ``metric_reduction``: ``actor/pg_loss`` and
``actor/rollout_kl`` are recomputed as the backend logs them (the whole batch's aggregate, or the
mean of each micro-batch's own aggregate), so the reference declaring micro-batch means is green
on the rollout-KL scenario (before: ``actor/rollout_kl`` 0.1147 vs a whole-batch 0.1218), and a
trainer declaring micro-batch means while logging whole-batch values is red."""

from __future__ import annotations

import dataclasses

import pytest

from rlaudit.data.io import load_rollout
from rlaudit.scenarios.invariants.base import with_overrides
from rlaudit.scenarios.spec import load_scenario
from rlaudit.targets.contract.own_adapters import ReferenceAdapter
from rlaudit.targets.run.runner import run_target_scenario
from rlaudit.verdict.result import FAIL, PASS

from conftest import REPO

pytestmark = pytest.mark.slow


class MicroMeanReference(ReferenceAdapter):
    """rlaudit's reference trainer, every loss-term metric logged as a micro-batch mean."""

    name = "micro-mean"
    metric_reduction = "microbatch-mean"


class DeclaresMicroMeansLogsWhole(MicroMeanReference):
    """Declares micro-batch means, logs every metric over the whole mini-batch."""

    name = "declares-micro-means"

    def replay(self, request):
        plain = {"trainer.metric_reduction": "contribution"}
        variants = [dataclasses.replace(v, config=with_overrides(v.config, **plain))
                    for v in request.variants]
        return super().replay(dataclasses.replace(request, variants=variants))


@pytest.fixture(scope="module")
def rollout_kl():
    scn = load_scenario(REPO / "scenarios" / "rollout_kl_loss.yaml")
    # 16 rows, micro-batches of 2: eight micro-batches with unequal token counts, so the mean of
    # their aggregates is not the whole batch's
    scn = dataclasses.replace(scn, config=with_overrides(
        scn.config, **{"actor.ppo_micro_batch_size_per_gpu": 2}))
    return scn, load_rollout(scn.rollout)


def _checks(adapter, rollout_kl):
    scn, batch = rollout_kl
    res = run_target_scenario(adapter, scn, batch, invariants=["rollout-correction"])
    return {c.backend: c for c in res.checks}


def test_micro_batch_means_recomputed_as_declared(rollout_kl):
    got = _checks(MicroMeanReference(), rollout_kl)
    for backend in ("micro-mean", "reference"):
        assert got[backend].status == PASS, (backend, got[backend].message)
        assert "values agree" in got[backend].message


def test_whole_batch_values_where_micro_means_are_declared_are_red(rollout_kl):
    got = _checks(DeclaresMicroMeansLogsWhole(), rollout_kl)
    c = got["declares-micro-means"]
    assert c.status == FAIL, c.message
    assert "actor/rollout_kl" in c.message and "actor/pg_loss" in c.message
    assert got["reference"].status == PASS, got["reference"].message
