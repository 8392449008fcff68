"""Drift localisation's analysis on hand-built runs and probe records (no model runs, no spawns):
stage classification, step/stage placement, the magnitude-scaled module tolerance, backward
blame, which failures are localised against what, and that a passing scenario runs none of it.
Expected values are worked out here from the injected differences, not read from the code."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from rlaudit import switches
from rlaudit.backends.base import VariantRun
from rlaudit.backends.probe import PREPARED_FIELDS
from rlaudit.backends.replay import RECORDED_FIELDS
from rlaudit.metrics import CATALOGUE
from rlaudit.scenarios import localise as L
from rlaudit.scenarios.localise_layers import backward_report, forward_report
from rlaudit.scenarios.localise_stages import (STAGES, TOKEN_STAGE, first_divergence_in_probe,
                                               first_divergence_in_runs, metric_stage)
from rlaudit.verdict.result import CheckResult, GoldenResult, ScenarioResult
from rlaudit.verdict.tolerance import Tolerance

RTOL, ATOL = 1e-7, 1e-9
B, R = 4, 5


class Scn:
    """The part of a Scenario the analysis reads."""

    def tol(self, name):
        return Tolerance(RTOL, ATOL)


def _tokens(seed=0):
    g = torch.Generator().manual_seed(seed)
    t = {name: torch.randn(B, R, generator=g, dtype=torch.float64)
         for name in ("probe_log_probs", "old_log_probs", "token_level_scores",
                      "token_level_rewards", "advantages", "returns")}
    return t


def _run(steps=2, tokens=None, params=None, metrics=None):
    metrics = metrics or [{"actor/pg_loss": 0.5 + s, "actor/grad_norm": 2.0 + s,
                           "critic/advantages/mean": 0.1} for s in range(steps)]
    params = params if params is not None else [torch.arange(6.0, dtype=torch.float64) + s
                                                for s in range(steps)]
    return VariantRun("base", steps=[dict(m) for m in metrics],
                      tokens={k: v.clone() for k, v in (tokens or _tokens()).items()},
                      params=[p.clone() for p in params], param_names=["a.weight", "b.weight"],
                      param_numels=[4, 2])


MASK = torch.ones(B, R, dtype=torch.bool)


def test_every_catalogue_metric_and_recorded_field_has_a_stage():
    golden = [n for n, s in CATALOGUE.items() if s.golden]
    assert [n for n in golden if metric_stage(n) is None] == []
    assert set(RECORDED_FIELDS) <= set(TOKEN_STAGE)
    assert set(PREPARED_FIELDS) <= set(TOKEN_STAGE)
    assert set(TOKEN_STAGE.values()) <= set(STAGES)


def test_identical_runs_have_no_divergence():
    assert first_divergence_in_runs(Scn(), _run(), _run(), MASK) is None


def test_advantages_differing_at_step0_are_placed_there_with_the_worst_token():
    got = _run()
    got.tokens["advantages"][2, 3] += 0.5          # one token, far out
    got.tokens["advantages"][1, 0] += 1e-3         # another, less far
    rep = first_divergence_in_runs(Scn(), got, _run(), MASK)
    assert (rep.step, rep.stage) == (0, "advantages")
    assert rep.agreed == ["scores", "old/ref log-probs", "KL in reward"]
    adv = rep.divergences[0]
    assert adv.quantity == "advantages" and adv.worst[0]["index"] == [2, 3]
    assert [w["index"] for w in adv.worst] == [[2, 3], [1, 0]]


def test_structural_failures_are_not_placed():
    got = _run()
    del got.tokens["returns"]
    rep = first_divergence_in_runs(Scn(), got, _run(), MASK)
    assert rep.stage is None and rep.structural == ["per-token returns present in only one run"]


def test_a_masked_token_does_not_count():
    got = _run()
    got.tokens["advantages"][0, 4] += 5.0
    mask = MASK.clone()
    mask[0, 4] = False
    assert first_divergence_in_runs(Scn(), got, _run(), mask) is None


def test_later_step_divergence_is_placed_in_the_first_divergent_step_and_stage():
    # step 0 agrees everywhere; at step 1 the grad norm and the parameters differ
    want = _run(steps=3)
    got = _run(steps=3)
    got.steps[1]["actor/grad_norm"] *= 1.01
    got.params[1][5] += 1.0
    got.params[2][5] += 1.0
    rep = first_divergence_in_runs(Scn(), got, want, MASK)
    assert (rep.step, rep.stage) == (1, "grad norm")
    assert "per-micro-batch loss" in rep.agreed and "advantages" in rep.agreed
    # and with the grad norm right, the parameters of b.weight (flat index 5 = b.weight[1])
    got.steps[1]["actor/grad_norm"] = want.steps[1]["actor/grad_norm"]
    rep = first_divergence_in_runs(Scn(), got, want, MASK)
    assert (rep.step, rep.stage) == (1, "parameters after the update")
    assert "(in b.weight[1])" in rep.divergences[0].message


def _opt(params, grads, *, loss=0.3, norm=1.0, lr=0.05, rows=(0, 1, 2, 3), lp=None):
    return {"rows": torch.tensor(rows), "log_probs": lp if lp is not None else
            torch.zeros(len(rows), R, dtype=torch.float64), "stats": {"actor/pg_loss": loss},
            "grads": grads.clone(), "grad_norm": norm, "lr": lr, "params": params.clone()}


def _probe(opt_steps):
    return {"spec": {"target_step": 0}, "steps": [{"prepared": {"advantages": torch.ones(B, R)},
                                                   "optimizer_steps": opt_steps}],
            "param_names": ["a.weight", "b.weight"], "param_numels": [4, 2],
            "params_initial": torch.zeros(6, dtype=torch.float64), "layers": None}


def test_probe_places_a_wrong_update_in_its_optimizer_step():
    grads = torch.linspace(-1, 1, 6, dtype=torch.float64)
    p0, p1 = -0.05 * grads, -0.1 * grads
    want = _probe([_opt(p0, grads), _opt(p1, grads, loss=0.2)])
    # got: the same first optimizer step, then a second update 1.5 times as large
    got = _probe([_opt(p0, grads), _opt(p0 + 1.5 * (p1 - p0), grads, loss=0.2)])
    rep = first_divergence_in_probe(Scn(), got, want, MASK)
    assert (rep.step, rep.stage, rep.optimizer_step) == (0, "parameters after the update", 1)
    assert {"per-micro-batch loss", "gradients", "grad norm"} <= set(rep.agreed)
    ratio = L.update_ratio(got, want, rep)
    assert ratio["median"] == pytest.approx(1.5) and ratio["p10"] == pytest.approx(1.5)


def test_probe_names_the_parameter_whose_gradient_differs():
    grads = torch.linspace(-1, 1, 6, dtype=torch.float64)
    bad = grads.clone()
    bad[4] *= 2                                  # b.weight[0]
    want = _probe([_opt(grads, grads)])
    got = _probe([_opt(grads, bad)])
    rep = first_divergence_in_probe(Scn(), got, want, MASK)
    assert (rep.step, rep.stage, rep.optimizer_step) == (0, "gradients", 0)
    assert [d.quantity for d in rep.divergences] == ["gradient of b.weight"]


# ---- module level ------------------------------------------------------------------------------

MODULES = ["model.embed_tokens", "model.layers.0.input_layernorm", "model.layers.0.self_attn",
           "model.layers.0.post_attention_layernorm", "model.layers.0.mlp", "model.layers.0",
           "model.norm", "lm_head"]
S, H = 6, 8


def _layers(scales: dict[str, float], *, seed=0, grads=None, param_grads=None):
    g = torch.Generator().manual_seed(seed)
    attn = torch.ones(2, S, dtype=torch.bool)
    attn[1, 4:] = False                          # row 1 is padded after 4 tokens
    outputs = {m: torch.randn(2, S, H, generator=g, dtype=torch.float64) * scales.get(m, 1.0)
               for m in MODULES}
    return {"role": "actor", "rows": [3, 7], "input_ids": torch.arange(2 * S).view(2, S),
            "attention_mask": attn, "prompt_lengths": torch.tensor([2, 3]), "outputs": outputs,
            "output_grads": grads if grads is not None else {m: t.clone() * 0.1
                                                            for m, t in outputs.items()},
            "param_grads": param_grads}


def _copy(layers):
    return {k: ({n: t.clone() for n, t in v.items()} if isinstance(v, dict) else v)
            for k, v in layers.items()}


def test_module_tolerance_scales_with_the_modules_magnitude():
    # the same absolute error 1e-5 is inside the bound of a module whose rms is 1000
    # (1e-9 + 1e-7 * 1000 = 1e-4), even at an entry that is exactly 0 (an elementwise relative
    # tolerance would flag it), and outside that of a module whose rms is ~1e-3
    want = _layers({"model.layers.0.self_attn": 1000.0, "model.layers.0.mlp": 1e-3})
    want["outputs"]["model.layers.0.self_attn"][0, 2, 1] = 0.0
    got = _copy(want)
    got["outputs"]["model.layers.0.self_attn"][0, 2, 1] += 1e-5
    got["outputs"]["model.layers.0.mlp"][0, 3, 5] += 1e-5
    rep = forward_report(Scn(), got, want)
    assert rep["module"] == "model.layers.0.mlp"
    curve = {c["module"]: c for c in rep["curve"]}
    assert not curve["model.layers.0.self_attn"]["out"]
    rms = float(want["outputs"]["model.layers.0.self_attn"].pow(2)
                .masked_select(want["attention_mask"].unsqueeze(-1)).mean().sqrt())
    assert curve["model.layers.0.self_attn"]["drift"] == pytest.approx(1e-5 / rms, rel=1e-3)
    tok = rep["worst_tokens"][0]
    assert (tok["row"], tok["position"], tok["part"]) == (3, 3, "response token 1")


def test_padded_positions_do_not_count():
    want = _layers({})
    got = _copy(want)
    got["outputs"]["model.layers.0.input_layernorm"][1, 5, :] += 10.0   # row 1 is padded at 5
    assert forward_report(Scn(), got, want)["module"] is None


def test_backward_blames_the_module_whose_parameter_gradients_alone_differ():
    pg = {"model.layers.0.mlp.gate_proj.weight": torch.randn(8, 4, dtype=torch.float64),
          "model.layers.0.self_attn.q_proj.weight": torch.randn(4, 4, dtype=torch.float64),
          "lm_head.weight": torch.randn(3, 4, dtype=torch.float64)}
    want = _layers({}, param_grads=pg)
    got = _copy(want)
    got["param_grads"]["model.layers.0.mlp.gate_proj.weight"][4:] *= 1.5   # one "TP shard"
    rep = backward_report(Scn(), got, want)
    assert rep["module"] == "model.layers.0.mlp"
    assert rep["what"].startswith("parameter gradients")
    entry = next(c for c in rep["curve"] if c["module"] == "model.layers.0.mlp")
    (p,) = [p for p in entry["params"] if p["out"]]
    assert p["ranges_out"] == [[4, 7, 8], [0, 3, 4]]
    # a wrong gradient of the loss w.r.t. the logits shows at the head, first in backward order
    got = _copy(want)
    got["output_grads"]["lm_head"] *= 2
    rep = backward_report(Scn(), got, want)
    assert rep["module"] == "lm_head" and "loss" in rep["what"]


# ---- which failures, what is compared ----------------------------------------------------------

def _result(checks, golden=()):
    res = ScenarioResult("s", "s.yaml", ["reference", "fsdp", "megatron"])
    res.checks = [CheckResult(i, b, st) for i, b, st in checks]
    res.golden = [GoldenResult(b, st, mismatches=m) for b, st, m in golden]
    return res


def test_failing_jobs():
    res = _result([("backend-parity", "fsdp", "fail"), ("backend-parity", "megatron", "pass"),
                   ("rollout-parity", "reference", "fail"), ("rollout-parity", "fsdp", "fail"),
                   ("microbatch-invariance", "megatron", "fail")],
                  [("reference", "pass", []), ("megatron", "fail", [])])
    pair, alone = L.failing_jobs(res)
    assert pair == {"fsdp": ["backend-parity"], "megatron": ["golden"]}
    assert alone == {"reference": ["rollout-parity"]}
    # the reference's own golden failure has no second run
    pair, alone = L.failing_jobs(_result([], [("reference", "fail", []), ("fsdp", "fail", [])]))
    assert pair == {} and alone == {"reference": ["golden"], "fsdp": ["golden"]}


def test_golden_only_entry_takes_the_first_step_and_earliest_stage():
    g = GoldenResult("reference", "fail", "2 mismatch(es)", mismatches=[
        {"metric": "actor/grad_norm", "step": 1, "value": 2.0, "golden": 1.0, "message": "x"},
        {"metric": "critic/advantages/mean", "step": 1, "value": 0.2, "golden": 0.1,
         "message": "y"},
        {"metric": "actor/pg_loss", "step": 2, "value": 1.0, "golden": 0.0, "message": "z"}])
    e = L.golden_entry(Scn(), "reference", ["golden"], g)
    assert (e["step"], e["stage"]) == (1, "advantages")
    assert [d["quantity"] for d in e["divergences"]] == ["critic/advantages/mean"]


def test_to_json_has_no_localisation_key_unless_something_was_localised():
    res = ScenarioResult("s", "s.yaml", ["reference"])
    assert "localisation" not in res.to_json()
    res.localisation = [{"backend": "fsdp", "summary": "x"}]
    assert res.to_json()["localisation"] == [{"backend": "fsdp", "summary": "x"}]


@pytest.mark.slow
def test_a_passing_scenario_runs_no_localisation(monkeypatch):
    """The engine reaches the localisation only on failure (in-process reference run)."""
    from rlaudit.scenarios import engine
    from rlaudit.scenarios.spec import load_scenario

    def boom(*a, **k):
        raise AssertionError("localisation ran for a passing scenario")

    monkeypatch.setattr(L, "localise_scenario", boom)
    scn = dataclasses.replace(load_scenario("scenarios/seed_entropy_coeff_zero.yaml"), steps=1,
                              invariants=["sanity-bounds"])
    res = engine.run_scenario(scn, backends=["reference"])
    assert res.passed and res.localisation == []
    assert "localisation" not in res.to_json()


def test_probe_cuts_large_outputs_to_rows_then_positions_alike_on_both_layouts():
    from rlaudit.backends.hooks import cut
    t = torch.arange(2 * 3 * 4).view(2, 3, 4)                 # [b, s, h]
    assert cut(t, 0, 1, 24) is t
    assert cut(t, 0, 1, 12).tolist() == t[:1].tolist()
    assert cut(t, 0, 1, 8).tolist() == t[:1, :2].tolist()
    sf = t.transpose(0, 1)                                     # megatron's [s, b, h]
    assert cut(sf, 1, 0, 8).transpose(0, 1).tolist() == t[:1, :2].tolist()


def test_fault_specs_parse_and_apply_only_where_named(monkeypatch):
    from rlaudit.backends import faults
    from rlaudit.backends.base import ReplayRequest
    from rlaudit.errors import InputError

    spec = "fsdp/base:lr_scale:factor=2;megatron:rmsnorm_eps:layer=1,eps=1e-2"
    assert [(f.backend, f.variant, f.kind) for f in faults.applying(spec, "fsdp", "base")] == \
        [("fsdp", "base", "lr_scale")]
    assert faults.applying(spec, "fsdp", "other") == []
    assert [f.params for f in faults.applying(spec, "megatron", "x")] == [
        {"layer": "1", "eps": "1e-2"}]
    assert faults.applying("", "fsdp", "base") == []
    monkeypatch.delenv(switches.FAULT, raising=False)
    assert ReplayRequest(model="m").faults == ""
    monkeypatch.setenv(switches.FAULT, "fsdp:nope")
    with pytest.raises(InputError, match="KIND one of"):
        ReplayRequest(model="m")
