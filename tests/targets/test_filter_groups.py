"""DAPO dynamic sampling as a target surface: the ``filter_groups`` stage checks, and targets
whose train_step filters itself (``filters_groups``) handed the unfiltered rows."""

from __future__ import annotations

import pytest
import torch

import broken_adapters as broken
from examples.toy_trainer.adapter import ToyAdapter
from rlaudit.backends.base import Variant
from rlaudit.verdict.result import FAIL, PASS
from rlaudit.targets.stages import run_stage_checks
from rlaudit.targets.stages.filter import default_filter_inputs
from rlaudit.targets.contract.own_adapters import ReferenceAdapter

STAGE = ["filter_groups"]


def statuses(adapter):
    return {c.invariant: c for c in run_stage_checks(adapter, stages=STAGE).checks}


@pytest.mark.parametrize("adapter", [ReferenceAdapter(), ToyAdapter()], ids=["reference", "toy"])
def test_correct_filters_pass(adapter):
    checks = statuses(adapter)
    assert set(checks) == {"filter_groups:kept-groups", "filter_groups:rows-aligned",
                           "filter_groups:no-mutation"}
    assert all(c.status == PASS for c in checks.values()), {k: c.message for k, c in
                                                            checks.items()}


def test_default_inputs_keep_the_hand_listed_groups():
    """Independent of rlaudit.algo.dapo: the groups each input keeps, listed by hand."""
    want = {"mixed": {10**12, 7, 2**40 + 3, 99},     # spread, singleton, spread, singleton
            "all-kept": {3, 1, 2}, "none-kept": set()}
    for inp in default_filter_inputs():
        kept = ReferenceAdapter().filter_groups(batch=inp.batch, metric=inp.metric)
        assert set(kept["uid"].tolist()) == want[inp.name], inp.name
        # groups are not contiguous in any input with more than one group
        uid = inp.batch["uid"].tolist()
        runs = sum(1 for a, b in zip(uid, uid[1:]) if a != b) + 1
        assert runs > len(set(uid)), inp.name


class _ByPosition(ReferenceAdapter):
    """Groups taken as consecutive runs of rows (contiguous groups assumed)."""

    name = "filter-by-position"

    def filter_groups(self, *, batch, metric):
        uid = batch["uid"]
        run = torch.cat([torch.zeros(1, dtype=torch.long),
                         (uid[1:] != uid[:-1]).long().cumsum(0)])
        from rlaudit.algo.dapo import filter_groups
        return batch.select(filter_groups(run, metric).nonzero().flatten())


class _KeepsEverything(ReferenceAdapter):
    name = "filter-keeps-everything"

    def filter_groups(self, *, batch, metric):
        return batch


class _ZeroesMaskedLogProbs(ReferenceAdapter):
    """Correct, but cleans values under the mask: not compared, so not flagged."""

    name = "filter-zeroes-masked"

    def filter_groups(self, *, batch, metric):
        kept = super().filter_groups(batch=batch, metric=metric)
        lp = torch.where(kept.mask, kept["rollout_log_probs"], 0.0)
        return dict(kept.tensors, rollout_log_probs=lp)


class _Reversed(ReferenceAdapter):
    """Correct, returns the kept rows in reverse order (order is not checked)."""

    name = "filter-reversed"

    def filter_groups(self, *, batch, metric):
        kept = super().filter_groups(batch=batch, metric=metric)
        return kept.select(range(len(kept) - 1, -1, -1))


@pytest.mark.parametrize("cls, fails", [
    (broken.FilterMisalignsScores, "filter_groups:rows-aligned"),
    (broken.FilterDropsSingletons, "filter_groups:kept-groups"),
    (_ByPosition, "filter_groups:kept-groups"),
    (_KeepsEverything, "filter_groups:kept-groups"),
    (_ZeroesMaskedLogProbs, None), (_Reversed, None),
], ids=lambda x: getattr(x, "name", x))
def test_filter_bugs_are_caught_and_harmless_choices_are_not(cls, fails):
    checks = statuses(cls())
    for name, c in checks.items():
        assert c.status == (FAIL if name == fails else PASS), (name, c.message)
    if cls is broken.FilterMisalignsScores:
        assert "scores" in checks[fails].message
    if cls is broken.FilterDropsSingletons:
        assert "single row" in checks[fails].message


def test_filter_writing_its_input_fails_no_mutation():
    class Mutates(ReferenceAdapter):
        name = "filter-mutates"

        def filter_groups(self, *, batch, metric):
            batch["scores"].clamp_(0, 1)
            return super().filter_groups(batch=batch, metric=metric)

    assert statuses(Mutates())["filter_groups:no-mutation"].status == FAIL


# ---- targets that filter in their own train_step --------------------------------------------

def _dapo():
    from rlaudit.data.io import load_rollout
    from rlaudit.scenarios.variants import build_variants
    from rlaudit.scenarios.spec import load_scenario, resolve
    from rlaudit.update.step import select_groups
    scn = load_scenario(resolve(["dapo_filter_overlong"], all_=False, root="scenarios")[0])
    raw = load_rollout(scn.rollout)
    batch = select_groups(raw, scn.config)[0]
    return scn, raw, batch, build_variants(scn, batch)


def test_filter_metric_runs_on_the_raw_score_where_the_penalty_makes_a_difference():
    """dapo_filter_overlong filters on seq_reward; filter-metric's variant filters on the raw
    score: the groups whose recorded scores are not all equal (by hand from the rollout), one
    step. Without the overlong penalty the two metrics agree and no variant is made."""
    import dataclasses

    from rlaudit.scenarios.invariants.reward import OTHER_METRIC, _other_metric_variants
    from rlaudit.scenarios.invariants.base import with_overrides
    scn, raw, batch, variants = _dapo()
    (v,) = [v for v in variants if v.name == OTHER_METRIC]
    assert v.config.algorithm.filter_groups.metric == "score" and v.steps == 1
    scores = {}
    for u, s in zip(raw["uid"].tolist(), raw["scores"].tolist()):
        scores.setdefault(u, []).append(s)
    spread = {u for u, ss in scores.items() if len(set(ss)) > 1}
    assert set(v.batch["uid"].tolist()) == spread != set(batch["uid"].tolist())
    no_penalty = dataclasses.replace(scn, config=with_overrides(
        scn.config, **{"reward.overlong_buffer.enable": False}))
    assert _other_metric_variants(no_penalty, batch) == []


def test_unfiltered_inputs_put_the_dropped_groups_back():
    from rlaudit.targets.inputs.dynamic_sampling import unfiltered_inputs
    scn, raw, batch, variants = _dapo()
    inputs, skipped = unfiltered_inputs(variants, raw)
    assert not skipped and set(inputs) == {v.name for v in variants}
    given = inputs["base"]
    assert len(raw) == 32 and len(batch) == 28 and len(given) == 32
    # the dropped group (uid 4: every seq_reward 0.9166...) sits at rows 0, 8, 16, 24; the kept
    # rows follow in the variant's order
    dropped = [i for i, u in enumerate(given["uid"].tolist()) if u == 4]
    assert dropped == [0, 8, 16, 24]
    rest = [i for i in range(32) if i not in dropped]
    for k in ("response_ids", "scores", "response_mask", "rollout_log_probs"):
        assert torch.equal(given[k][rest], batch[k]), k
    # a correct self-filtering trainer gets back exactly the variant's rows
    from rlaudit.update.step import filter_metric
    kept = ToyAdapter().filter_groups(batch=given, metric=filter_metric(given, scn.config))
    assert torch.equal(kept["response_ids"], batch["response_ids"])
    assert torch.equal(kept["scores"], batch["scores"])


def test_a_variant_the_filter_would_change_is_not_run_with_the_reason():
    from rlaudit.targets.inputs.dynamic_sampling import unfiltered_inputs
    scn, raw, batch, _ = _dapo()
    # two rows of group 0 with the same score: that group has no spread in this variant
    uid0 = (batch["uid"] == 0).nonzero().flatten().tolist()
    same = [i for i in uid0 if float(batch["scores"][i]) == float(batch["scores"][uid0[2]])]
    sub = Variant("subset", scn.config, batch.select(same[:2]), 1)
    inputs, skipped = unfiltered_inputs([sub], raw)
    assert not inputs and "would not keep exactly" in skipped["subset"]


@pytest.mark.slow
def test_self_filtering_trainer_misaligning_a_field_is_caught_at_run_level():
    """A toy trainer whose own DAPO filter re-takes ``scores`` from the unfiltered batch: caught
    by backend parity on the DAPO scenario because it is handed the unfiltered rows. Declared
    as not filtering (it then gets rows its filter keeps in full), the same bug is invisible:
    the surface the declaration opens is what catches it. (The correct toy is green on this
    scenario: test_run_level's every-shipped-scenario test.)"""
    from rlaudit.targets.run.runner import run_target
    for cls, want in ((broken.FilterMisalignsScores, FAIL),
                      (type("Undeclared", (broken.FilterMisalignsScores,),
                            {"filters_groups": False, "name": "undeclared"}), PASS)):
        adapter = cls()
        (res,) = run_target(adapter, scenario_names=["dapo_filter_overlong"], stages=[],
                            invariants=["backend-parity"])[1:]
        (c,) = [c for c in res.checks if c.backend == adapter.name]
        assert c.status == want, (adapter.name, c.message)
        if want == FAIL:
            assert "actor/grad_norm" in c.message or "score" in c.message


class _FiltersOnTheRawScore(broken.toy.ToyTrainer):
    @staticmethod
    def filter_groups(data, metric):    # DAPO filter on the rule score, whatever the metric
        return broken.toy.ToyTrainer.filter_groups(data, data["scores"].double())


class _PenaltyFromTrainedTokens(broken.toy.ToyTrainer):
    def overlong_penalty(self, data):   # length = trained tokens (a tool's output left out)
        width = data["responses"].shape[1]
        full = data["attention_mask"][:, -width:]
        return super().overlong_penalty({**data, "attention_mask": torch.cat(
            [full[:, :-width], data["response_mask"].to(full.dtype)], dim=1)})


def _data_flow(res, adapter):
    """The target's data-flow row (upstream.first_difference), the one row naming the cause."""
    from rlaudit.targets.run.upstream import DATA_FLOW
    (row,) = [c for c in res.checks if c.invariant == DATA_FLOW]
    assert row.backend == adapter.name and row.status == FAIL, row
    return row.message


@pytest.mark.slow
def test_a_self_filtering_trainer_keeping_other_groups_is_a_finding_not_bad_input():
    """A toy trainer whose own DAPO filter reads the raw score instead of ``seq_reward`` keeps
    24 of the 32 rows it is handed where the reference keeps 28: a finding of the run (exit 1),
    not a malformed adapter (exit 2). Its reward shaping is right, so the data-flow row blames
    the filter itself, and the variant run again on the reference's 28 rows with the filter off
    agrees with the reference (backend-parity still reports, and passes). A penalty taken from
    the count of trained tokens instead of the length changes which groups survive too (its row
    28 has a hole inside the overlong buffer: no penalty, its group loses the spread the penalty
    gave it): there the cause named is upstream, reward shaping."""
    from rlaudit.targets.run.runner import run_target
    adapter = broken.toy_with(_FiltersOnTheRawScore, "filters-on-the-raw-score")()
    (res,) = run_target(adapter, scenario_names=["dapo_filter_overlong"], stages=[],
                        invariants=["backend-parity"])[1:]
    msg = _data_flow(res, adapter)
    assert "kept 24 of the 32 rows" in msg and "keeps 28" in msg, msg
    assert "filter_groups keeps different rows" in msg and "the filter itself" in msg, msg
    assert "upstream:" not in msg and not res.errors and not res.passed
    (parity,) = [c for c in res.checks if c.invariant == "backend-parity"]
    assert parity.backend == adapter.name and parity.status == PASS, parity.message
    adapter = broken.toy_with(_PenaltyFromTrainedTokens, "penalty-from-trained-tokens")()
    (res,) = run_target(adapter, scenario_names=["dapo_filter_overlong"], stages=[],
                        invariants=["reward-shaping"])[1:]
    msg = _data_flow(res, adapter)
    assert msg.startswith("variant base: upstream: reward-shaping differs (token_level_scores"), msg
    assert "filter_groups keeps different rows as a consequence" in msg, msg
    shaping = {c.backend: c for c in res.checks if c.invariant == "reward-shaping"}
    assert shaping[adapter.name].status == FAIL and shaping["reference"].status == PASS


@pytest.mark.slow
def test_a_missing_overlong_penalty_is_named_upstream_and_reward_checks_still_run():
    """A self-filtering toy without DAPO's overlong penalty: on dapo_filter_overlong the penalty
    is what gives one group its spread on ``seq_reward``, so its filter keeps 24 of the 32 rows
    where the reference keeps 28. The data-flow row names the first stage that differs --
    reward shaping, upstream of the filter -- and the filter as a consequence; reward-shaping
    itself still reports, on the reference's rows: the scores and the logged penalty mean (0.0
    where the reference's is negative) are wrong; the reference passes it."""
    from rlaudit.targets.run.runner import run_target
    adapter = broken.NoOverlongPenalty()
    (res,) = run_target(adapter, scenario_names=["dapo_filter_overlong"], stages=[],
                        invariants=["reward-shaping"])[1:]
    msg = _data_flow(res, adapter)
    assert msg.startswith("variant base: upstream: reward-shaping differs"), msg
    assert "filter_groups keeps different rows as a consequence" in msg, msg
    assert "kept 24 of the 32 rows" in msg and "keeps 28" in msg, msg
    assert not res.errors
    shaping = {c.backend: c for c in res.checks if c.invariant == "reward-shaping"}
    assert shaping[adapter.name].status == FAIL, shaping[adapter.name].message
    assert "train/overlong_penalty_mean = 0.0" in shaping[adapter.name].message
    assert shaping["reference"].status == PASS, shaping["reference"].message


@pytest.mark.slow
def test_a_filter_adding_the_penalty_to_the_raw_score_is_caught_by_filter_metric():
    """A blind audit's bug: a self-filtering trainer adding the overlong penalty to the metric
    ``score`` too passed --all, as the only shipped filtering scenario filters on
    ``seq_reward``, where the two agree. filter-metric's one-step run on the raw score hands it
    32 rows of which the reference keeps 24 (group 7's scores are all equal; only the penalty
    gives it spread); the base run alone does not see it. Its reward shaping is right: the
    data-flow row blames the filter."""
    from rlaudit.targets.run.runner import run_target
    adapter = broken.PenaltyInEveryFilterMetric()
    (res,) = run_target(adapter, scenario_names=["dapo_filter_overlong"], stages=[],
                        invariants=["reward-shaping"])[1:]
    assert res.passed, [(c.invariant, c.backend, c.message) for c in res.checks]
    (res,) = run_target(adapter, scenario_names=["dapo_filter_overlong"], stages=[],
                        invariants=["filter-metric"])[1:]
    msg = _data_flow(res, adapter)
    assert "metric 'score'" in msg and "the filter itself" in msg, msg
    assert "kept 28 of the 32 rows" in msg and "keeps 24" in msg, msg
    assert not res.passed
