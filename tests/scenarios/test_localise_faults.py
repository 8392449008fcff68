"""Drift localisation names each injected fault (issue #16): one fault at a time, injected into a
built-in backend through rlaudit/backends/faults.py, and the localisation must name the step, the
stage and (where the model is at fault) the module, and nothing earlier.

One spawned group per backend, in one test item each (so pytest-xdist cannot launch a group
twice): the group replays one copy of the cheapest variant per fault (the fault keyed by the
copy's name, the probe on), and the reference replays the same variant once in-process; then the
two phases of rlaudit.scenarios.localise run on those runs exactly as the engine runs them after
a failure. A last test runs the engine itself on a failing scenario. Expectations come from the
fault, not from the code under test: the layer the fault is in, the TP shard it touches, the
learning-rate factor.

Model: qwen2-tiny-short (2 decoder layers, intermediate 256, float64); 8 rows, one step, one
optimizer step (mini-batch = the batch).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import json

import pytest

from rlaudit.backends.base import ReplayRequest, Variant
from rlaudit.backends.probe import ProbeSpec
from rlaudit.data.io import load_rollout
from rlaudit.scenarios.invariants.base import with_overrides
from rlaudit.scenarios.localise import entry_summary, finish_with_probe, pair_entry
from rlaudit.scenarios.localise_layers import backward_report, forward_report
from rlaudit.scenarios.spec import load_scenario

pytestmark = pytest.mark.slow

SCENARIO = "scenarios/seed_entropy_coeff_zero.yaml"
ROWS = 8                  # two prompt groups of 4
LR_FACTOR = 1.5
HAVE_MEGATRON = importlib.util.find_spec("megatron") is not None


@functools.lru_cache(maxsize=1)
def _scenario_and_variant():
    scn = dataclasses.replace(load_scenario(SCENARIO), steps=1)
    batch = load_rollout(scn.rollout).select(range(ROWS))
    cfg = with_overrides(scn.config, **{"actor.ppo_mini_batch_size": ROWS // scn.config.rollout.n})
    return scn, Variant("base", cfg, batch, steps=1,
                        probe=ProbeSpec(target_step=0, rows=tuple(range(ROWS))))


@functools.lru_cache(maxsize=1)
def _reference_run():
    from rlaudit.backends.reference import ReferenceBackend

    scn, v = _scenario_and_variant()
    return ReferenceBackend().replay(ReplayRequest(model=str(scn.model), variants=[v],
                                                   dtype=scn.dtype, faults=""))["base"]


def _replay_faults(backend, layout: dict, faults: dict[str, str]) -> dict:
    """One spawned group: a copy of the variant per fault, named after it."""
    scn, v = _scenario_and_variant()
    spec = ";".join(f"{backend.name}/{name}:{fault}" for name, fault in faults.items() if fault)
    request = ReplayRequest(model=str(scn.model), dtype=scn.dtype, layout=layout, faults=spec,
                            variants=[dataclasses.replace(v, name=n) for n in faults])
    return backend.replay(request)


def _localise(backend: str, run) -> tuple[dict, ProbeSpec | None]:
    """What the engine does after a failure, on runs that already carry their probe records."""
    scn, v = _scenario_and_variant()
    want = _reference_run()
    variant = dataclasses.replace(v, name=run.name)
    entry, spec = pair_entry(scn, backend, ["backend-parity"], variant, run, want)
    if spec is not None:
        finish_with_probe(scn, entry, v.batch.mask, run.info["probe"], want.info["probe"])
    entry["summary"] = entry_summary(entry)
    print(entry["summary"])
    return entry, spec


def _curve(entry) -> dict[str, dict]:
    return {c["module"]: c for c in entry["layers"]["curve"]}


# ---- FSDP: softmax scale in layer 0, advantages with the wrong group, learning rate --------------

def test_fsdp_faults_are_localised():
    """FSDP (dp=2): softmax scale in layer 0, advantages with the wrong group, learning rate."""
    from rlaudit.backends.fsdp import FSDPBackend

    runs = _replay_faults(FSDPBackend(), {"dp": 2}, {
        "softmax": "softmax_scale:layer=0,factor=1.25",
        "advantages": "advantage_group:shift=1",
        "lr": f"lr_scale:factor={LR_FACTOR}"})
    check_softmax_scale_in_layer0_is_named_as_layer0_attention(runs["softmax"])
    check_wrong_advantage_group_is_named_as_advantages_before_any_model_op(runs["advantages"])
    check_wrong_learning_rate_is_named_as_the_parameter_update(runs["lr"])


def check_softmax_scale_in_layer0_is_named_as_layer0_attention(run):
    entry, spec = _localise("fsdp", run)
    assert spec is not None and (entry["step"], entry["stage"]) == (0, "old/ref log-probs")
    layers = entry["layers"]
    assert layers["direction"] == "forward"
    assert layers["module"] == "model.layers.0.self_attn"
    curve = _curve(entry)
    # everything before the attention of layer 0 agrees; its output and all after it do not
    assert not curve["model.embed_tokens"]["out"]
    assert not curve["model.layers.0.input_layernorm"]["out"]
    assert curve["lm_head"]["out"]
    assert layers["worst_tokens"], "the worst token positions at the first module"


def check_wrong_advantage_group_is_named_as_advantages_before_any_model_op(run):
    entry, spec = _localise("fsdp", run)
    assert spec is None, "no probe needed: a batch-preparation stage at step 0"
    assert (entry["step"], entry["stage"]) == (0, "advantages")
    assert "old/ref log-probs" in entry["agreed"]
    assert {d["quantity"] for d in entry["divergences"]} >= {"advantages"}
    assert "before any model op" in entry["summary"]


def check_wrong_learning_rate_is_named_as_the_parameter_update(run):
    entry, spec = _localise("fsdp", run)
    assert spec is not None
    assert (entry["step"], entry["stage"], entry["optimizer_step"]) == \
        (0, "parameters after the update", 0)
    # every forward quantity of step 0 agrees: log-probs, loss, gradients, grad norm, modules
    for stage in ("old/ref log-probs", "advantages", "per-micro-batch loss", "gradients",
                  "grad norm"):
        assert stage in entry["agreed"]
    assert entry["layers"]["module"] is None
    assert not any(c.get("out") for c in entry["layers"]["curve"])
    assert entry["update"]["median"] == pytest.approx(LR_FACTOR, rel=1e-9)
    assert entry["update"]["p10"] == pytest.approx(LR_FACTOR, rel=1e-6)


# ---- Megatron (TP=2): RMSNorm epsilon in layer 1, a gradient scaled on one TP shard -------------

@pytest.mark.skipif(not HAVE_MEGATRON, reason="megatron-core is not installed "
                    "(pip install rlaudit[megatron])")
def test_megatron_faults_are_localised():
    """Megatron (tp=2): RMSNorm epsilon in layer 1, a gradient scaled on one TP shard, and a
    clean copy as the control."""
    from rlaudit.backends.megatron.backend import MegatronBackend

    runs = _replay_faults(MegatronBackend(), {"tp": 2}, {
        "eps": "rmsnorm_eps:layer=1,norm=input,eps=1e-2",
        "tpgrad": "grad_scale:module=model.layers.0.mlp,tp_rank=1,factor=1.5",
        "clean": ""})
    check_clean_megatron_run_localises_nothing(runs["clean"])
    check_rmsnorm_eps_in_layer1_is_named_as_that_norm(runs["eps"])
    check_gradient_scaled_on_one_tp_shard_is_named_as_that_modules_backward(runs["tpgrad"])


def check_clean_megatron_run_localises_nothing(run):
    """The control: without a fault nothing diverges, at any stage or module, forward or
    backward (measured: module outputs <= 2e-14, gradients <= 2e-13 of their magnitude)."""
    scn, v = _scenario_and_variant()
    entry, spec = pair_entry(scn, "megatron", ["backend-parity"], v, run, _reference_run())
    assert entry["step"] is None and spec is None
    got = run.info["probe"]["layers"]
    want = _reference_run().info["probe"]["layers"]
    forward, backward = forward_report(scn, got, want), backward_report(scn, got, want)
    assert forward["module"] is None and backward["module"] is None
    assert len(forward["curve"]) == 2 + 2 * 5 + 1, "embedding, 2 x 5 per layer, norm, head"
    assert max(c["drift"] for c in forward["curve"]) < 1e-12


def check_rmsnorm_eps_in_layer1_is_named_as_that_norm(run):
    entry, spec = _localise("megatron", run)
    assert (entry["step"], entry["stage"]) == (0, "old/ref log-probs")
    assert entry["layers"]["module"] == "model.layers.1.input_layernorm"
    curve = _curve(entry)
    for name in ("model.embed_tokens", "model.layers.0.input_layernorm", "model.layers.0.self_attn",
                 "model.layers.0.mlp", "model.layers.0"):
        assert not curve[name]["out"], name      # not layer 0 ...
    assert curve["lm_head"]["out"]              # ... and the head only downstream of it


def check_gradient_scaled_on_one_tp_shard_is_named_as_that_modules_backward(run):
    entry, spec = _localise("megatron", run)
    assert (entry["step"], entry["stage"], entry["optimizer_step"]) == (0, "gradients", 0)
    assert "per-micro-batch loss" in entry["agreed"]
    layers = entry["layers"]
    assert layers["direction"] == "backward" and layers["forward_module"] is None
    assert layers["module"] == "model.layers.0.mlp"
    assert layers["what"].startswith("parameter gradients")
    params = {p["parameter"]: p for p in _curve(entry)["model.layers.0.mlp"]["params"]}
    inter = 256  # intermediate_size: TP rank 1 holds rows 128..255 of gate/up, columns of down
    for name in ("gate_proj", "up_proj"):
        assert params[f"model.layers.0.mlp.{name}.weight"]["ranges_out"][0] == \
            [inter // 2, inter - 1, inter]
    assert params["model.layers.0.mlp.down_proj.weight"]["ranges_out"][1] == \
        [inter // 2, inter - 1, inter]
    # the gradient reaching every module agrees, and no other module's parameters differ
    assert not any(c["out"] for c in layers["curve"])
    assert [c["module"] for c in layers["curve"] if c["params_out"]] == ["model.layers.0.mlp"]


# ---- the engine path: a failing scenario is localised with one probe re-run per side -------------

def test_engine_localises_a_failing_scenario_with_one_extra_replay_per_side(monkeypatch):
    from rlaudit.backends.fsdp import FSDPBackend
    from rlaudit.backends.reference import ReferenceBackend
    from rlaudit.report.console import render_result
    from rlaudit.scenarios.engine import run_scenario

    calls = []
    for cls in (FSDPBackend, ReferenceBackend):
        original = cls.replay

        def counted(self, request, _original=original, _name=cls.name):
            calls.append((_name, [(v.name, v.probe is not None) for v in request.variants]))
            return _original(self, request)
        monkeypatch.setattr(cls, "replay", counted)
    monkeypatch.setenv("RLAUDIT_FAULT", "fsdp:softmax_scale:layer=0,factor=1.25")
    scn = dataclasses.replace(load_scenario(SCENARIO), steps=1, invariants=["backend-parity"],
                              backends={"reference": {}, "fsdp": {"dp": 1}})
    res = run_scenario(scn)
    assert not res.passed
    probes = [c for c in calls if any(p for _, p in c[1])]
    assert sorted(b for b, _ in probes) == ["fsdp", "reference"]
    assert all(len(variants) == 1 for _, variants in probes), "one variant per side"
    (entry,) = res.localisation
    assert entry["backend"] == "fsdp" and entry["checks"] == ["backend-parity"]
    assert entry["layers"]["module"] == "model.layers.0.self_attn"
    assert entry["probe"]["seconds"] > 0 and "error" not in entry["probe"]
    text = render_result(res)
    assert "    where: step 0, stage \"old/ref log-probs\", first module out of tolerance " \
           "(forward): model.layers.0.self_attn" in text
    doc = json.loads(json.dumps(res.to_json(), default=str))
    assert doc["localisation"][0]["summary"] == entry["summary"]
