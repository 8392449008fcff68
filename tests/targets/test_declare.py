"""Declarations an adapter makes about itself (rlaudit/targets/contract/declare.py):
precision-derived tolerances, explicit overrides, declared differences (a convention the reference computes under,
or the third state "differs"), metric reduction, per-loss-mode capabilities, padding compared
with the trainer's own micro-batches. Each declaration must silence exactly the false alarm it
is for and nothing else: every test pairs "correct trainer with its convention passes" with "a
real bug under the same declaration still fails"."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from rlaudit.algo import advantages as ref_adv
from rlaudit.algo.agg import AGG_MODES, agg_loss
from rlaudit.algo.kl import kl_penalty as kl_estimate
from rlaudit.data.batch import RolloutBatch
from rlaudit.errors import InputError
from rlaudit.verdict.result import CheckResult, DIFFERS, FAIL, NA, PASS
from rlaudit.verdict.tolerance import Tolerance
from rlaudit.targets import Difference
from rlaudit.targets.stages import run_stage_checks
from rlaudit.targets.contract.declare import STAGE_TOLERANCES, read_declarations, scaled
from rlaudit.targets.contract.own_adapters import ReferenceAdapter
from rlaudit.targets.run.parity import apply_differences


def statuses(adapter, stages):
    return {c.invariant: c for c in run_stage_checks(adapter, stages=stages).checks}


# ---- validation ------------------------------------------------------------------------------

@pytest.mark.parametrize("attrs, key", [
    ({"precision": "float16"}, "precision"),
    ({"train_precision": "fp32"}, "train_precision"),
    ({"metric_reduction": "mean"}, "metric_reduction"),
    ({"tolerances": {"policy_loss": {"rtol": -1}}}, "tolerances.policy_loss.rtol"),
    ({"tolerances": {"policy_loss": {"rel": 1e-3}}}, "tolerances.policy_loss"),
    ({"stage_precision": {"nope": "float32"}}, "stage_precision"),
    ({"differences": ("x",)}, "differences[0]"),
    ({"differences": (Difference("d", "why", "", ("agg_loss:parity",)),)},
     "differences[0].link"),
    ({"differences": (Difference("d", "why", "url", ()),)}, "differences[0].checks"),
    ({"differences": (Difference("d", "why", "url", ("*",), convention={"nope": "x"}),)},
     "differences[0].convention"),
    ({"differences": (Difference("d", "why", "url", ("*",),
                                 convention={"outcome_score": "max"}),)},
     "differences[0].convention.outcome_score"),
    ({"differences": (Difference("d", "a", "u", ("*",)), Difference("d", "b", "u", ("*",)))},
     "differences"),
])
def test_bad_declarations_are_input_errors_naming_the_attribute(attrs, key):
    adapter = type("Declared", (ReferenceAdapter,), {"name": "declared", **attrs})()
    with pytest.raises(InputError) as e:
        read_declarations(adapter)
    assert e.value.key == key and e.value.exit_code == 2


def test_tolerance_derivation_and_overrides():
    class A(ReferenceAdapter):
        precision = "float32"
        stage_precision = {"kl_penalty": "float64"}
        tolerances = {"agg_loss:parity": {"rtol": 0.5}, "actor/grad_norm": {"atol": 1.0}}
        train_precision = "bfloat16"
    d = read_declarations(A())
    assert d.stage_tolerance("policy_loss:parity") == STAGE_TOLERANCES["float32"]
    assert d.stage_tolerance("kl_penalty:parity") == STAGE_TOLERANCES["float64"]
    assert d.stage_tolerance("agg_loss:parity") == Tolerance(rtol=0.5, atol=0.0)
    assert d.stage_tolerance("agg_loss:global-split") == STAGE_TOLERANCES["float32"]
    assert d.run_overrides() == {"actor/grad_norm": Tolerance(rtol=0.0, atol=1.0)}
    assert d.run_floor().rtol >= 1e-2
    # atol scales with the magnitude of the expected values (never below 1x)
    t = Tolerance(rtol=0.0, atol=1e-6)
    assert scaled(t, torch.tensor([0.0, 1e-3])).atol == 1e-6
    assert scaled(t, torch.tensor([-40.0, 2.0])).atol == pytest.approx(4e-5)
    assert scaled(t, torch.tensor([float("nan"), 3.0])).atol == pytest.approx(3e-6)


# ---- precision: a float32 trainer is not a bug, and its bugs are still bugs ------------------

class Float32KL(ReferenceAdapter):
    """KL-in-reward computed in float32, as slime does: correct, but not float64-exact."""

    name = "float32-kl"

    def apply_kl_in_reward(self, *, token_level_scores, old_log_probs, ref_log_probs,
                           response_mask, kl_coef, kl_penalty):
        kl = kl_estimate(old_log_probs.float(), ref_log_probs.float(), kl_penalty)
        kl = torch.where(response_mask, kl, 0.0)
        rewards = token_level_scores.float() - kl_coef * kl
        return rewards.double(), kl.double()


class Float32KLInPlace(Float32KL):
    """The same float32 trainer with slime's pre-#2114 bug: the stored KL is shaped in place."""

    def apply_kl_in_reward(self, *, token_level_scores, old_log_probs, ref_log_probs,
                           response_mask, kl_coef, kl_penalty):
        kl = torch.where(response_mask, kl_estimate(old_log_probs.float(), ref_log_probs.float(),
                                                    kl_penalty), 0.0)
        rewards = kl
        rewards *= -kl_coef
        rewards += token_level_scores.float()
        return rewards.double(), kl.double()


def test_float32_trainer_fails_as_float64_and_passes_declared():
    stage = ["apply_kl_in_reward"]
    undeclared = statuses(Float32KL(), stage)
    assert undeclared["apply_kl_in_reward:stored-kl-unaltered"].status == FAIL
    assert "rtol=1e-07" in undeclared["apply_kl_in_reward:stored-kl-unaltered"].message
    declared = statuses(type("F32", (Float32KL,), {"precision": "float32"})(), stage)
    for name in ("apply_kl_in_reward:stored-kl-unaltered", "apply_kl_in_reward:parity"):
        assert declared[name].status == PASS, declared[name].message
        assert "rtol=2e-05" in declared[name].message        # the tolerance used is printed
    buggy = statuses(type("F32Bug", (Float32KLInPlace,), {"precision": "float32"})(), stage)
    assert buggy["apply_kl_in_reward:stored-kl-unaltered"].status == FAIL


class EpsilonWhitening(ReferenceAdapter):
    """REINFORCE++-baseline whitened with an epsilon in the masked mean's denominator (verl's
    ``masked_mean``: sum / (count + 1e-8)): a one-row batch is then whitened from ~1e-8 instead
    of exactly 0 and amplified by rsqrt(var + 1e-8) to ~1e-7."""

    name = "eps-whitening"
    advantage_estimators = ("reinforce_plus_plus_baseline",)

    def compute_advantages(self, *, estimator, token_level_rewards, response_mask, uid,
                           **_):
        m = response_mask.to(token_level_rewards.dtype)
        scores = (token_level_rewards * m).sum(-1)
        _, mean, _ = ref_adv.group_stats(uid, scores)
        n, _, _ = ref_adv.group_stats(uid, scores)
        centred = (scores - torch.where(n == 1, 0.0, mean)).unsqueeze(-1) * m
        mu = (centred * m).sum() / (m.sum() + 1e-8)
        var = ((centred - mu) ** 2 * m).sum() / (m.sum() - 1).clamp(min=1)
        adv = (centred - mu) * torch.rsqrt(var + 1e-8) * m
        return adv, adv.clone()


def test_epsilon_amplified_by_whitening_is_within_a_magnitude_scaled_float32_tolerance():
    stage = ["compute_advantages"]
    assert statuses(EpsilonWhitening(), stage)["compute_advantages:parity"].status == FAIL
    ok = statuses(type("E32", (EpsilonWhitening,), {"precision": "float32"})(), stage)
    assert ok["compute_advantages:parity"].status == PASS, ok["compute_advantages:parity"].message


# ---- declared differences --------------------------------------------------------------------

class NaNOnEmpty(ReferenceAdapter):
    """agg_loss divides by the local token count: NaN on a batch without a valid token when no
    global counts are given (verl's agg_loss)."""

    name = "nan-on-empty"

    def agg_loss(self, *, loss_mat, mask, mode, denominators=None):
        if denominators is None and not bool(mask.any()):
            return loss_mat.sum() * float("nan")
        return agg_loss(loss_mat, mask, mode, denominators)


NAN_DIFF = Difference("agg-loss-nan-on-empty", reason="divides by the local token count",
                      link="https://example.org/agg_loss", checks=("agg_loss:parity",),
                      cases=("without a valid token",))


class NaNOnEmptyAndTokenSumBug(NaNOnEmpty):
    """The same declared difference, plus an undeclared bug: seq-mean-token-sum divided by the
    token count."""

    def agg_loss(self, *, loss_mat, mask, mode, denominators=None):
        if mode == "seq-mean-token-sum" and bool(mask.any()):
            return agg_loss(loss_mat, mask, "token-mean", denominators)
        return super().agg_loss(loss_mat=loss_mat, mask=mask, mode=mode,
                                denominators=denominators)


def test_declared_difference_is_its_own_state_and_never_hides_an_undeclared_one():
    stage = ["agg_loss"]
    assert statuses(NaNOnEmpty(), stage)["agg_loss:parity"].status == FAIL
    declared = type("Declared", (NaNOnEmpty,), {"differences": (NAN_DIFF,)})()
    c = statuses(declared, stage)["agg_loss:parity"]
    assert c.status == DIFFERS and c.ok
    assert "agg-loss-nan-on-empty" in c.message and "example.org" in str(c.details)
    assert c.details["differences"]["agg-loss-nan-on-empty"]["count"] >= 4   # one per mode
    # the other checks of the stage are not touched by it
    assert statuses(declared, stage)["agg_loss:global-split"].status == PASS
    both = type("Both", (NaNOnEmptyAndTokenSumBug,), {"differences": (NAN_DIFF,)})()
    c = statuses(both, stage)["agg_loss:parity"]
    assert c.status == FAIL and "seq-mean-token-sum" in c.message


class UnmaskedOutcome(ReferenceAdapter):
    """Outcome estimators score a row by the sum of *every* token reward (verl's
    ``token_level_rewards.sum(dim=-1)``)."""

    name = "unmasked-outcome"
    advantage_estimators = ("grpo", "rloo")

    def compute_advantages(self, *, estimator, token_level_rewards, response_mask, uid,
                           **kw):
        scores = token_level_rewards.sum(-1)
        n, mean, std = ref_adv.group_stats(uid, scores)
        if estimator == "grpo":
            norm = kw.get("norm_adv_by_std_in_grpo", True)
            mean = torch.where(n == 1, 0.0, mean)
            std = torch.where(n == 1, 1.0, std)
            row = (scores - mean) / (std + ref_adv.GRPO_EPS) if norm else scores - mean
        else:
            row = torch.where(n > 1, (scores - mean) * n / (n - 1).clamp(min=1), scores)
        adv = torch.where(response_mask, row.unsqueeze(-1), 0.0)
        return adv, adv.clone()


OUTCOME = Difference("outcome-score-unmasked-sum", reason="scores sum every position",
                     link="https://example.org/core_algos", checks=("compute_advantages:*",),
                     convention={"outcome_score": "unmasked-sum"})


def test_convention_runs_the_check_under_the_declared_semantics():
    stage = ["compute_advantages"]
    undeclared = statuses(UnmaskedOutcome(), stage)
    assert undeclared["compute_advantages:masked-values"].status == FAIL
    declared = statuses(type("D", (UnmaskedOutcome,), {"differences": (OUTCOME,)})(), stage)
    for name in ("parity", "row-permutation", "masked-values"):
        assert declared[f"compute_advantages:{name}"].status == PASS, name
    # the convention is not a blanket: an adapter that declares it but sums only the masked
    # rewards fails parity on inputs with rewards under the mask
    liar = statuses(type("L", (ReferenceAdapter,), {"differences": (OUTCOME,),
                                                    "advantage_estimators": ("grpo",)})(), stage)
    assert liar["compute_advantages:parity"].status == FAIL


def test_outcome_score_convention_by_hand():
    r = torch.tensor([[1.0, 2.0, 4.0], [0.5, 0.0, 0.0]], dtype=torch.float64)
    m = torch.tensor([[True, False, True], [True, False, False]])
    uid = torch.tensor([7, 7])
    # masked scores 5, 0.5 -> mean 2.75; unmasked 7, 0.5 -> mean 3.75 (Dr.GRPO: score - mean)
    adv, _ = ref_adv.compute_advantages("drgrpo", token_level_rewards=r, response_mask=m, uid=uid)
    assert adv[0, 0] == 2.25 and adv[1, 0] == -2.25 and adv[0, 1] == 0
    adv, _ = ref_adv.compute_advantages("drgrpo", token_level_rewards=r, response_mask=m, uid=uid,
                                        outcome_score="unmasked-sum")
    assert adv[0, 0] == 3.25 and adv[1, 0] == -3.25 and adv[0, 1] == 0
    with pytest.raises(InputError):
        ref_adv.compute_advantages("grpo", token_level_rewards=r, response_mask=m, uid=uid,
                                   outcome_score="mean")


# ---- metric reduction ------------------------------------------------------------------------

class LocalMeanMetrics(ReferenceAdapter):
    """Loss with global denominators (correct), metrics as the micro-batch's own means (verl's
    AggregationType.MEAN)."""

    name = "local-mean-metrics"

    def policy_loss(self, *, denominators=None, **kw):
        loss, _ = super().policy_loss(denominators=denominators, **kw)
        _, metrics = super().policy_loss(denominators=None, **kw)
        return loss, metrics


def test_microbatch_mean_metrics_are_checked_as_local_means():
    stage = ["policy_loss"]
    assert statuses(LocalMeanMetrics(), stage)["policy_loss:global-split"].status == FAIL
    declared = type("M", (LocalMeanMetrics,), {"metric_reduction": "microbatch-mean"})()
    c = statuses(declared, stage)["policy_loss:global-split"]
    assert c.status == PASS, c.message
    # declaring it does not make contribution metrics pass: they are not local means
    c = statuses(type("C", (ReferenceAdapter,), {"metric_reduction": "microbatch-mean"})(),
                 stage)["policy_loss:global-split"]
    assert c.status == FAIL and "local mean" in c.message


# ---- capabilities per loss mode --------------------------------------------------------------

class GSPOFixedAgg(ReferenceAdapter):
    """GSPO always aggregated seq-mean-token-mean, whatever loss_agg_mode says."""

    name = "gspo-fixed-agg"
    loss_modes = ("vanilla", "gspo")

    def policy_loss(self, *, loss_mode, loss_agg_mode, **kw):
        if loss_mode == "gspo":
            loss_agg_mode = "seq-mean-token-mean"
        return super().policy_loss(loss_mode=loss_mode, loss_agg_mode=loss_agg_mode, **kw)


def test_loss_agg_modes_per_loss_mode():
    stage = ["policy_loss"]
    c = statuses(GSPOFixedAgg(), stage)["policy_loss:parity"]
    assert c.status == FAIL and c.message.startswith("gspo/")
    seen = set()

    class Honest(GSPOFixedAgg):
        loss_agg_modes = {"gspo": ("seq-mean-token-mean",)}

        def policy_loss(self, **kw):
            seen.add((kw["loss_mode"], kw["loss_agg_mode"]))
            return super().policy_loss(**kw)
    checks = statuses(Honest(), stage)
    assert checks["policy_loss:parity"].status == PASS
    # gspo is asked only for its one mode, vanilla (not in the mapping) for every mode
    assert {a for m, a in seen if m == "gspo"} == {"seq-mean-token-mean"}
    assert {a for m, a in seen if m == "vanilla"} == set(AGG_MODES)


# ---- KL in reward gets the response lengths ---------------------------------------------------

class NeedsLengths(ReferenceAdapter):
    """Places the KL by response length (slime's per-sample layout) and checks it got them."""

    name = "needs-lengths"
    seen: list = []

    def apply_kl_in_reward(self, *, response_lengths, response_mask, **kw):
        width = response_mask.shape[1]
        assert response_lengths.dtype == torch.int64
        inside = torch.arange(width).unsqueeze(0) < response_lengths.unsqueeze(1)
        assert not bool((response_mask & ~inside).any())      # no valid token past its length
        self.seen.append(len(response_lengths))
        return super().apply_kl_in_reward(response_mask=response_mask, **kw)


def test_apply_kl_in_reward_receives_response_lengths():
    adapter = NeedsLengths()
    checks = statuses(adapter, ["apply_kl_in_reward"])
    assert checks["apply_kl_in_reward:parity"].status == PASS, checks
    assert adapter.seen


# ---- padding compared with the trainer's own micro-batches ------------------------------------

def _own_format(mb: dict) -> dict:
    """A SkyRL-like trainer's micro-batch: its own fields only, float32."""
    keep = ("prompt_ids", "prompt_lengths", "response_ids", "response_lengths", "response_mask",
            "old_log_probs", "advantages", "rollout_log_probs")
    return {k: (v.float() if v.is_floating_point() else v) for k, v in mb.items() if k in keep}


class OwnFieldsMicrobatcher(ReferenceAdapter):
    """Carries only the fields it uses, in float32, and builds padding from its own template."""

    name = "own-fields"

    def make_microbatches(self, batch, **kw):
        ranks = super().make_microbatches(batch, **kw)
        return [[_own_format(dict(mb.tensors) if isinstance(mb, RolloutBatch) else dict(mb))
                 for mb in rank] for rank in ranks]


class OwnFieldsHardCodedPadding(OwnFieldsMicrobatcher):
    """...but its padding micro-batches come from a hard-coded key list without
    rollout_log_probs (SkyRL before PR #1811)."""

    def make_microbatches(self, batch, **kw):
        ranks = super().make_microbatches(batch, **kw)
        return [[mb if bool(mb["response_mask"].any()) else
                 {k: v for k, v in mb.items() if k != "rollout_log_probs"} for mb in rank]
                for rank in ranks]


def test_padding_complete_compares_with_the_trainers_own_microbatches():
    stage = ["make_microbatches"]
    ok = statuses(OwnFieldsMicrobatcher(), stage)
    assert all(c.status == PASS for c in ok.values()), {k: c.message for k, c in ok.items()}
    bad = statuses(OwnFieldsHardCodedPadding(), stage)["make_microbatches:padding-complete"]
    assert bad.status == FAIL and "rollout_log_probs" in bad.message and "padding" in bad.message


# ---- run level -------------------------------------------------------------------------------

def test_run_level_differences_cover_all_problems_or_none():
    decl = read_declarations(type("R", (ReferenceAdapter,), {"differences": (
        Difference("loss-type", "TRL's dapo loss", "https://example.org/trl",
                   checks=("backend-parity",), cases=("actor/pg_loss",)),)})())
    one = CheckResult("backend-parity", "t", FAIL, "step 0: actor/pg_loss = 1, expected 2",
                      {"failures": [{"message": "step 0: actor/pg_loss = 1, expected 2"}]})
    two = CheckResult("backend-parity", "t", FAIL, "m", {"failures": [
        {"message": "step 0: actor/pg_loss = 1, expected 2"},
        {"message": "step 0: actor/grad_norm = 1, expected 2"}]})
    other_backend = CheckResult("backend-parity", "reference", FAIL, "actor/pg_loss", {})
    out = apply_differences([one, two, other_backend], "t", decl)
    assert [r.status for r in out] == [DIFFERS, FAIL, FAIL]
    assert "loss-type" in out[0].message and out[0].details["differences"]["loss-type"]["count"] == 1
    # dp-invariance compares with the same reference: backend-parity's declarations hold there
    dp = dataclasses.replace(one, invariant="dp-invariance")
    (dp_out,) = apply_differences([dp], "t", decl)
    assert dp_out.status == DIFFERS
    (other_check,) = apply_differences([dataclasses.replace(one, invariant="sanity-bounds")],
                                       "t", decl)
    assert other_check.status == FAIL
    # the red one leads with what is not declared, the declared one counted after it
    assert out[1].message.startswith("1 undeclared problem(s): step 0: actor/grad_norm = 1")
    assert "loss-type (1 problem(s))" in out[1].message
    assert out[1].details["undeclared"] == ["step 0: actor/grad_norm = 1, expected 2"]


def test_scenario_tolerance_floor_and_overrides():
    from rlaudit.targets.run.runner import declared_scenario
    from rlaudit.targets.inputs import builtin
    scn = builtin.scenario(builtin.tiny_model_path())
    scn.tolerances = {"actor/entropy": Tolerance(rtol=1e-3, atol=0.0)}
    decl = read_declarations(type("F", (ReferenceAdapter,), {
        "train_precision": "float32", "tolerances": {"params": {"rtol": 0.1, "atol": 0.2}}})())
    s = declared_scenario(scn, decl)
    assert s.tol("actor/pg_loss") == Tolerance(rtol=1e-4, atol=1e-5)     # the float32 floor
    assert s.tol("actor/entropy") == Tolerance(rtol=1e-3, atol=1e-5)    # looser scenario value
    assert s.tol("params") == Tolerance(rtol=0.1, atol=0.2)             # explicit override
    assert scn.tol("actor/pg_loss").rtol < 1e-4                         # the original untouched
    micro = declared_scenario(scn, read_declarations(type("M", (ReferenceAdapter,), {
        "metric_reduction": "microbatch-mean"})()))
    assert micro.config.trainer.metric_reduction == "microbatch-mean"
    assert scn.config.trainer.metric_reduction == "contribution"


# ---- conventions: N_seq over every row, GRPO's epsilon -----------------------------------------

class AllRowsAgg(ReferenceAdapter):
    """Seq-mean aggregations divide by every row, empty ones included (SkyRL, slime, TRL)."""

    name = "all-rows"

    def agg_loss(self, *, loss_mat, mask, mode, denominators=None):
        from rlaudit.algo.agg import Denominators
        if denominators is None:
            denominators = Denominators.of(mask, seq_count="all-rows")
        return agg_loss(loss_mat, mask, mode, denominators)


ALL_ROWS = Difference("seq-mean-over-all-rows", reason="N_seq counts every row",
                      link="https://example.org/skyrl", checks=("agg_loss:*", "policy_loss:*"),
                      convention={"seq_count": "all-rows"})


def test_seq_count_convention():
    stage = ["agg_loss"]
    c = statuses(AllRowsAgg(), stage)["agg_loss:parity"]
    problems = c.details["problems"]
    assert c.status == FAIL and all(p.startswith("seq-mean") for p in problems), problems
    declared = statuses(type("D", (AllRowsAgg,), {"differences": (ALL_ROWS,)})(), stage)
    assert declared["agg_loss:parity"].status == PASS, declared["agg_loss:parity"].message
    assert declared["agg_loss:global-split"].status == PASS
    liar = statuses(type("L", (ReferenceAdapter,), {"differences": (ALL_ROWS,)})(), stage)
    assert liar["agg_loss:parity"].status == FAIL


def test_seq_count_all_rows_by_hand():
    from rlaudit.algo.agg import Denominators
    loss = torch.tensor([[1.0, 2.0], [4.0, 0.0], [9.0, 9.0]], dtype=torch.float64)
    mask = torch.tensor([[True, True], [True, False], [False, False]])
    # seq-mean-token-sum: (3 + 4) / 2 valid rows, or / 3 rows
    assert float(agg_loss(loss, mask, "seq-mean-token-sum")) == 3.5
    d = Denominators.of(mask, seq_count="all-rows")
    assert (d.tokens, d.seqs) == (3.0, 3.0)
    assert float(agg_loss(loss, mask, "seq-mean-token-sum", d)) == pytest.approx(7 / 3)
    assert float(agg_loss(loss, mask, "token-mean", d)) == pytest.approx(7 / 3)


class TRLGroupEps(ReferenceAdapter):
    """GRPO divided by (std + 1e-4), TRL's epsilon."""

    name = "eps-1e-4"
    advantage_estimators = ("grpo",)

    def compute_advantages(self, **kw):
        return ref_adv.compute_advantages(kw.pop("estimator"), **kw, grpo_std_eps=1e-4)


def test_grpo_std_eps_convention():
    stage = ["compute_advantages"]
    assert statuses(TRLGroupEps(), stage)["compute_advantages:parity"].status == FAIL
    eps = Difference("trl-eps", reason="std + 1e-4", link="https://example.org/trl",
                     checks=("compute_advantages:*",), convention={"grpo_std_eps": 1e-4})
    ok = statuses(type("D", (TRLGroupEps,), {"differences": (eps,)})(), stage)
    assert ok["compute_advantages:parity"].status == PASS, ok["compute_advantages:parity"].message
    wrong = Difference("trl-eps", reason="std + 1e-3", link="https://example.org/trl",
                       checks=("compute_advantages:*",), convention={"grpo_std_eps": 1e-3})
    bad = statuses(type("W", (TRLGroupEps,), {"differences": (wrong,)})(), stage)
    assert bad["compute_advantages:parity"].status == FAIL


def test_per_metric_reduction_declaration():
    class Mixed(ReferenceAdapter):
        metric_reduction = {"actor/pg_loss": "contribution", "*": "microbatch-mean"}

        def policy_loss(self, *, denominators=None, **kw):
            loss, metrics = super().policy_loss(denominators=denominators, **kw)
            _, local = super().policy_loss(denominators=None, **kw)
            return loss, {**local, "actor/pg_loss": metrics["actor/pg_loss"]}
    d = read_declarations(Mixed())
    assert d.metric_mode("actor/pg_loss") == "contribution"
    assert d.metric_mode("actor/ppo_kl") == "microbatch-mean"
    assert d.config_overrides() == {"trainer.metric_reduction": "microbatch-mean",
                                    "trainer.metric_reduction_except": ["actor/pg_loss"]}
    assert statuses(Mixed(), ["policy_loss"])["policy_loss:global-split"].status == PASS
    # all micro-batch means declared: pg_loss (a contribution here) is caught
    every = type("E", (Mixed,), {"metric_reduction": "microbatch-mean"})()
    assert statuses(every, ["policy_loss"])["policy_loss:global-split"].status == FAIL
    with pytest.raises(InputError) as e:
        read_declarations(type("U", (ReferenceAdapter,), {"metric_reduction": {"actor/nope": "contribution"}})())
    assert e.value.key == "metric_reduction"


def test_token_denominator_batch_mean_on_the_reference_backend(tiny_model, builtin_rollout):
    """TRL's dapo normaliser: every optimizer step divides by the batch's tokens / number of
    mini-batches. With lr 0 both mini-batches are on-policy (per-token loss = -A), so the logged
    pg_loss (mean over the two optimizer steps) is -sum(A m) / N_tok of the whole batch under
    batch-mean, and the mean of the per-mini-batch token means otherwise."""
    from rlaudit.backends.base import ReplayRequest
    from rlaudit.backends.reference import ReferenceBackend
    from rlaudit.scenarios.invariants.base import base_variant
    from rlaudit.targets.inputs import builtin
    scn = builtin.scenario(tiny_model)
    runs = {}
    for mode in ("minibatch", "batch-mean"):
        v = base_variant(scn, builtin_rollout, mode, steps=1, **{
            "actor.loss_token_denominator": mode, "actor.optim.lr": 0.0, "actor.ppo_epochs": 1})
        (run,) = ReferenceBackend().replay(ReplayRequest(
            model=str(scn.model), ref_model=str(scn.ref_model), variants=[v],
            dtype="float64")).values()
        runs[mode] = run
    adv = runs["minibatch"].tokens["advantages"]
    m = builtin_rollout.mask
    half = len(m) // 2                               # two mini-batches of 4 rows
    parts = [(-adv[s] * m[s]).sum() / m[s].sum() for s in (slice(0, half), slice(half, None))]
    assert runs["minibatch"].steps[0]["actor/pg_loss"] == pytest.approx(float(sum(parts) / 2),
                                                                       abs=1e-12)
    want = float((-adv * m).sum() / m.sum())
    assert runs["batch-mean"].steps[0]["actor/pg_loss"] == pytest.approx(want, abs=1e-12)
    assert abs(want - float(sum(parts) / 2)) > 1e-3    # the layout makes them differ


class SequenceGSPO(ReferenceAdapter):
    """GSPO differentiated through the sequence mean (slime's, TRL's)."""

    name = "gspo-sequence"
    loss_modes = ("gspo",)

    def policy_loss(self, **kw):
        return super().policy_loss(**kw, gspo_gradient="sequence")


def test_gspo_gradient_convention():
    stage = ["policy_loss"]
    got = statuses(SequenceGSPO(), stage)["policy_loss:parity"]
    assert got.status == FAIL and "gradient" in got.message, got.message
    seq = Difference("gspo-seq", reason="GSPO, eq. 7", link="https://example.org/slime",
                     checks=("policy_loss:*",), convention={"gspo_gradient": "sequence"})
    ok = statuses(type("D", (SequenceGSPO,), {"differences": (seq,)})(), stage)
    assert ok["policy_loss:parity"].status == PASS, ok["policy_loss:parity"].message
    assert all(c.status in (PASS, NA) for c in ok.values()), {
        k: c.message for k, c in ok.items() if c.status not in (PASS, NA)}
    # declaring the convention without following it fails
    bad = statuses(type("W", (ReferenceAdapter,), {"loss_modes": ("gspo",),
                                                   "differences": (seq,)})(), stage)
    assert bad["policy_loss:parity"].status == FAIL


class UnclampedK3(ReferenceAdapter):
    """k3 with no clamp of its value at 10 (TRL's beta term), written out here."""
    name = "unclamped-k3"

    def kl_penalty(self, *, log_prob, ref_log_prob, kind):
        if kind not in ("k3", "low_var_kl"):
            return super().kl_penalty(log_prob=log_prob, ref_log_prob=ref_log_prob, kind=kind)
        d = (ref_log_prob - log_prob).clamp(-20, 20)
        return torch.exp(d) - d - 1

    def apply_kl_in_reward(self, *, token_level_scores, old_log_probs, ref_log_probs,
                           response_mask, kl_coef, kl_penalty):
        kl = torch.where(response_mask, self.kl_penalty(
            log_prob=old_log_probs, ref_log_prob=ref_log_probs, kind=kl_penalty), 0.0)
        return token_level_scores - kl_coef * kl, kl


def test_k3_clamp_convention_at_stage_level():
    """On a case where ref - logp = 3 (k3 = e^3 - 4 = 16.1, past verl's clamp at 10), the KL
    stage checks fail an unclamped k3 undeclared and pass it under ``k3_clamp: none``; the same
    declaration does not excuse a k3 that is wrong below the clamp."""
    from dataclasses import replace
    from rlaudit.targets.inputs.cases import default_cases
    from rlaudit.targets.stages import StageEnv
    from rlaudit.targets.stages.advantage import kl_penalty_parity, kl_reward_parity
    base = default_cases()[1]
    far = replace(base, tensors={**base.tensors, "ref_log_probs": torch.where(
        base.mask, base["log_probs"] + 3.0, 0.0), "old_log_probs": base["log_probs"]})
    unclamped = Difference("k3-unclamped", reason="no value clamp", link="https://example.org",
                           checks=("kl_penalty:*", "apply_kl_in_reward:*"),
                           convention={"k3_clamp": "none"})

    def checks(adapter):
        env = StageEnv(adapter, cases=[far], overrides={"kl_estimators": ("k3",)})
        return kl_penalty_parity(env).status, kl_reward_parity(env).status

    assert checks(UnclampedK3()) == (FAIL, FAIL)
    declared = type("D", (UnclampedK3,), {"differences": (unclamped,)})
    assert checks(declared()) == (PASS, PASS)
    assert checks(ReferenceAdapter()) == (PASS, PASS)

    class Halved(declared):                      # a real bug under the same declaration
        def kl_penalty(self, **kw):
            return super().kl_penalty(**kw) / 2
    assert checks(Halved()) == (FAIL, FAIL)
