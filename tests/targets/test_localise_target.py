"""Drift localisation for --target: a ToyTrainer whose model has a wrong RMSNorm epsilon in
decoder layer 1 is localised to that norm through the adapter's probe_model hook; a trainer that
drops the temperature is localised to after the LM head (every module agrees); without the hook,
step and stage come from TrainStepOutput alone."""

from __future__ import annotations

import pytest

import broken_adapters as broken
from examples.toy_trainer import trainer as toy
from rlaudit.targets.inputs import builtin
from rlaudit.targets.run.runner import run_target_scenario

pytestmark = pytest.mark.slow


class _WrongNormEps(toy.ToyTrainer):
    def __init__(self, model, cfg, ref_model=None):
        model.model.layers[1].input_layernorm.variance_epsilon = 1.0   # HF default 1e-6
        super().__init__(model, cfg, ref_model)


WrongEps = broken.toy_with(_WrongNormEps, "wrong-eps")
WrongEpsNoHook = type("WrongEpsNoHook", (WrongEps,), {"probe_model": None,
                                                      "name": "wrong-eps-no-hook"})


def _entry(adapter, tiny_model, builtin_rollout):
    scn = builtin.scenario(tiny_model, ["backend-parity"],
                           ref_model_path=builtin.tiny_model_path(None, "llama"))
    res = run_target_scenario(adapter, scn, builtin_rollout, invariants=["backend-parity"])
    assert not res.passed
    (entry,) = res.localisation
    assert entry["backend"] == adapter.name and (entry["step"], entry["stage"]) == \
        (0, "old/ref log-probs")
    return entry


def test_target_model_faults_are_localised_through_probe_model(tiny_model, builtin_rollout):
    entry = _entry(WrongEps(), tiny_model, builtin_rollout)
    assert entry["layers"]["module"] == "model.layers.1.input_layernorm"
    curve = {c["module"]: c for c in entry["layers"]["curve"]}
    assert not any(curve[m]["out"] for m in curve if m.startswith("model.layers.0")), \
        "layer 0 of a stock HF float64 model is within the hf-float64 floor"

    entry = _entry(broken.IgnoresTemperature(), tiny_model, builtin_rollout)
    assert entry["layers"]["module"] is None
    assert "after the LM head" in entry["summary"]

    entry = _entry(WrongEpsNoHook(), tiny_model, builtin_rollout)
    assert "layers" not in entry and "defines no probe_model" in entry["note"]
