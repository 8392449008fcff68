"""run_target and `rlaudit run --target`: loading adapters, the stages pseudo-scenario, named
scenarios, exit codes."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

import broken_adapters as broken
from rlaudit.errors import InputError
from rlaudit.verdict.result import FAIL, NA, PASS
from rlaudit.targets.contract.load import load_adapter
from rlaudit.targets.contract.own_adapters import ReferenceAdapter
from rlaudit.targets.inputs import builtin
from rlaudit.targets.run.runner import run_target

REPO = Path(__file__).resolve().parents[2]


class GroupsByPositionOnly:
    """A stage-only adapter (no train_step) with the position-grouping bug."""

    name = "position-only"

    def compute_advantages(self, **kw):
        return broken.GroupsByPosition().compute_advantages(**kw)


instance = broken.OnlyAdvantages()


@pytest.mark.parametrize("spec, match", [
    ("no_colon", "MODULE:ATTR"), ("a:b:c", "MODULE:ATTR"), (":Attr", "MODULE:ATTR"),
    ("surely_not_a_module_x:Adapter", "cannot import"), ("test_runner:Missing", "no attribute"),
    ("test_runner:REPO", "provides none of the stages"),
])
def test_load_adapter_errors_name_the_problem(spec, match):
    with pytest.raises(InputError, match=match):
        load_adapter(spec)


def test_load_adapter_instantiates_classes_and_accepts_instances():
    assert isinstance(load_adapter("test_runner:GroupsByPositionOnly"), GroupsByPositionOnly)
    assert load_adapter("test_runner:instance") is instance


def test_load_adapter_falls_back_to_the_current_directory(monkeypatch):
    """`rlaudit run --target examples....` from the repository root, through the installed
    script (whose sys.path has no cwd)."""
    monkeypatch.chdir(REPO)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".", str(REPO))])
    for mod in [m for m in sys.modules if m == "examples" or m.startswith("examples.")]:
        monkeypatch.delitem(sys.modules, mod)
    adapter = load_adapter("examples.toy_trainer.adapter:ToyAdapter")
    assert adapter.name == "toy" and str(REPO) in sys.path


def test_reference_name_is_reserved():
    class Named(ReferenceAdapter):
        name = "reference"

    with pytest.raises(InputError, match="reserved"):
        run_target(Named(), stages=["kl_penalty"])


def test_without_train_step_run_level_is_na(tmp_path):
    results = run_target(GroupsByPositionOnly(), scenarios_dir=REPO / "scenarios")
    stages, scenario = results
    assert stages.scenario == "stages" and not stages.passed
    assert scenario.checks[0].status == NA and "train_step" in scenario.checks[0].message
    statuses = {c.invariant: c.status for c in stages.checks}
    assert statuses["compute_advantages:parity"] == FAIL
    assert statuses["policy_loss:parity"] == NA


def test_unknown_scenario_is_an_input_error(tmp_path):
    with pytest.raises(InputError, match="no scenario named"):
        run_target(GroupsByPositionOnly(), scenario_names=["nope"], scenarios_dir=tmp_path)


@pytest.mark.slow
def test_named_scenario_file(tmp_path, tiny_model, builtin_rollout):
    """A scenario file (the user's own rollout and config) instead of the built-in one; its
    backend list is replaced by the target and the reference."""
    from rlaudit.data.io import save_rollout
    save_rollout(builtin_rollout, tmp_path / "r.safetensors")
    (tmp_path / "mine.yaml").write_text(
        f"model: {tiny_model}\nrollout: r.safetensors\nsteps: 1\ndtype: float64\n"
        f"config: {{rollout: {{n: 4, temperature: {builtin.TEMPERATURE}}}, "
        "actor: {ppo_mini_batch_size: 2, optim: {name: sgd, lr: 0.1}}}\n"
        "backends: {reference: {}}\ninvariants: [no-input-mutation, backend-parity]\n"
        "tolerances: {default: {rtol: 1.0e-5, atol: 1.0e-6}}\n")
    from examples.toy_trainer.adapter import ToyAdapter
    results = run_target(ToyAdapter(), scenario_names=["mine"], scenarios_dir=tmp_path,
                         stages=[])
    scn = results[1]
    assert scn.scenario == "mine" and scn.backends == ["toy", "reference"]
    mine = {c.invariant: c.status for c in scn.checks if c.backend == "toy"}
    assert mine == {"no-input-mutation": PASS, "backend-parity": PASS}
    assert scn.passed


@pytest.mark.slow
def test_all_runs_the_builtin_scenario_and_every_shipped_one(tmp_path, tiny_model,
                                                             builtin_rollout):
    """``--all`` is the default run plus every scenario of the folder: the built-in scenario
    first (a blind audit, 2026-11-27: --all had dropped it, the only scenario running
    padding-microbatches-complete on a target's own padding path); named scenarios alone when
    named."""
    from rlaudit.data.io import save_rollout
    save_rollout(builtin_rollout, tmp_path / "r.safetensors")
    (tmp_path / "mine.yaml").write_text(
        f"model: {tiny_model}\nrollout: r.safetensors\nsteps: 1\ndtype: float64\n"
        f"config: {{rollout: {{n: 4, temperature: {builtin.TEMPERATURE}}}, "
        "actor: {ppo_mini_batch_size: 2, optim: {name: sgd, lr: 0.1}}}\n"
        "backends: {reference: {}}\ninvariants: [no-input-mutation]\n")
    from examples.toy_trainer.adapter import ToyAdapter
    every = run_target(ToyAdapter(), all_=True, scenarios_dir=tmp_path, stages=[],
                       invariants=["no-input-mutation"])
    assert [r.scenario for r in every] == ["stages", "target-builtin", "mine"]
    named = run_target(ToyAdapter(), scenario_names=["mine"], scenarios_dir=tmp_path, stages=[],
                       invariants=["no-input-mutation"])
    assert [r.scenario for r in named] == ["stages", "mine"]
    # stages=[]: the stage pseudo-scenario ran no check, so nothing applied there (never a pass)
    assert [r.state for r in every] == ["n/a", "passed", "passed"]
    assert [r.state for r in named] == ["n/a", "passed"]


@pytest.mark.slow
def test_cli_exit_codes_and_json(tmp_path, capsys, monkeypatch):
    from rlaudit.cli.main import main
    monkeypatch.chdir(REPO)
    common = ["--no-mlflow", "--report-dir", str(tmp_path), "--json"]
    assert main(["run", "--target", "test_runner:instance", *common]) == 0
    seen = capsys.readouterr()
    out = json.loads(seen.out)
    assert out[0]["scenario"] == "stages" and out[0]["passed"]
    # no scenario named: stderr says what --all would add, stdout stays JSON only
    assert "`--all` replays every shipped scenario" in seen.err
    assert main(["run", "--target", "test_runner:GroupsByPositionOnly", *common]) == 1
    out = json.loads(capsys.readouterr().out)
    failed = [c["invariant"] for c in out[0]["checks"] if c["status"] == FAIL]
    assert "compute_advantages:parity" in failed
    assert main(["run", "--target", "nowhere_at_all:X", *common]) == 2


def test_a_target_run_says_on_stderr_what_it_left_out():
    """Named scenarios replace the built-in one: said, as the unnamed run says what --all adds
    (a blind audit's trainer was green on four named scenarios, red on the built-in one)."""
    from rlaudit.cli.run import target_scope_note
    assert "`--all` replays every shipped scenario" in target_scope_note(None, False)
    assert "`--all` replays every shipped scenario" in target_scope_note([], False)
    named = target_scope_note(["kl_k1"], False)
    assert "named scenarios only" in named and "built-in scenario" in named
    assert "no scenario is named, or with `--all`" in named
    assert target_scope_note(None, True) is None and target_scope_note(["kl_k1"], True) is None


def test_to_variant_run_validates_what_train_step_returns():
    from rlaudit.backends.base import Variant
    from rlaudit.config import Config
    from rlaudit.targets.contract.adapter import TrainStepOutput
    from rlaudit.targets.run.target_backend import to_variant_run
    from rlaudit.targets.stages.batch import microbatch_input
    batch = microbatch_input()
    v = Variant("base", Config(), batch, steps=1)
    ok = TrainStepOutput(metrics=[{"actor/pg_loss": torch.tensor(0.5)}],
                         tokens={"advantages": torch.zeros(batch.mask.shape)},
                         microbatches=[[[[batch, dict(batch.tensors)]]]])
    run = to_variant_run(v, ok, source="x.train_step")
    assert run.steps == [{"actor/pg_loss": 0.5}] and "advantages" in run.tokens
    assert [m["padding"] for m in run.micro_log[0][0][0]] == [False, False]
    bad = [(TrainStepOutput(metrics=[]), "metrics"),
           (TrainStepOutput(metrics=[{"a": "x"}]), "metrics"),
           (TrainStepOutput(metrics=[{}], log_probs=torch.zeros(2, 2)), "probe_log_probs"),
           (TrainStepOutput(metrics=[{}], tokens={"advantage": torch.zeros(1)}), "tokens"),
           (TrainStepOutput(metrics=[{}], microbatches=[[[batch]]]), "microbatches")]
    for out, key in bad:
        with pytest.raises(InputError, match=key):
            to_variant_run(v, out, source="x.train_step")

