"""The reference trainer: determinism, checkpoint/resume, DAPO filter exhaustion, job validation,
and `rlaudit train` end to end. Tiny settings: n=4, 2 prompts per step, 6 response tokens."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

from rlaudit.cli.main import main
from rlaudit.errors import InputError, UnknownNameError
from rlaudit.model.load import load_model
from rlaudit.rollout.tasks import TASKS, Task
from rlaudit.trainer.trainer import FilterExhausted, Trainer, TrainJob

REPO = Path(__file__).resolve().parents[2]
MODEL = REPO / "scenarios" / "models" / "qwen2-tiny"


def job_dict(**over) -> dict:
    """Task `short` with seed 1: both steps have a score spread, so both steps move the weights
    (and AdamW's moments matter for step 2)."""
    d = {"model": str(MODEL), "task": "short",
         "rollout": {"n": 4, "response_length": 6},
         "data": {"train_batch_size": 2},
         "actor": {"ppo_mini_batch_size": 2, "ppo_micro_batch_size_per_gpu": 4,
                   "optim": {"name": "adamw", "lr": 1.0e-2}},
         "trainer": {"total_steps": 2, "seed": 1}}
    for k, v in over.items():
        d[k] = {**d[k], **v} if isinstance(v, dict) and isinstance(d.get(k), dict) else v
    return d


def no_timing(history: list[dict]) -> list[dict]:
    return [{k: v for k, v in m.items() if not k.startswith("timing/")} for m in history]


def weights(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.actor.model.state_dict().items()}


def assert_same_weights(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.fixture(scope="module")
def uninterrupted():
    """2 steps from scratch: (history, weights after step 1, weights after step 2)."""
    tr = Trainer(TrainJob.from_dict(job_dict(trainer={"total_steps": 1})))
    tr.train(progress=False)
    after1 = weights(tr)
    tr.job.config.trainer.total_steps = 2
    history = tr.train(progress=False)
    return history, after1, weights(tr)


def test_metrics_are_meaningful(uninterrupted):
    history, after1, after2 = uninterrupted
    assert len(history) == 2
    for m in history:
        # 2 prompts x n=4 responses of at most 6 tokens: the batch is what the config says
        assert m["train/num_kept_groups"] == 2.0 and m["train/num_gen_batches"] == 1.0
        assert 1.0 <= m["response_length/min"] <= m["response_length/max"] <= 6.0
        assert m["critic/score/max"] > m["critic/score/min"]  # a spread: a real gradient
        assert m["actor/grad_norm"] > 0
    a, b = no_timing(history)
    assert a != b  # different prompts/samples per step: the resume test can tell steps apart
    changed = [k for k in after1 if not torch.equal(after1[k], after2[k])]
    assert changed


def test_same_seed_gives_identical_metrics(uninterrupted):
    history, _, after2 = uninterrupted
    tr = Trainer(TrainJob.from_dict(job_dict()))
    again = tr.train(progress=False)
    assert no_timing(again) == no_timing(history)
    assert_same_weights(weights(tr), after2)


def test_another_seed_gives_other_metrics(uninterrupted):
    history, _, _ = uninterrupted
    tr = Trainer(TrainJob.from_dict(job_dict(trainer={"total_steps": 1, "seed": 2})))
    assert no_timing(tr.train(progress=False))[0] != no_timing(history)[0]


def test_checkpoint_and_resume_reproduce_the_uninterrupted_run(uninterrupted, tmp_path):
    history, after1, after2 = uninterrupted
    ck = tmp_path / "ckpt"
    first = Trainer(TrainJob.from_dict({**job_dict(trainer={"total_steps": 1}),
                                        "checkpoint_dir": str(ck), "save_freq": 1}))
    first.train(progress=False)
    # what is on disk: step_1/ and the latest marker, no half-written temporaries
    assert sorted(p.name for p in ck.iterdir()) == ["latest", "step_1"]
    assert (ck / "latest").read_text().strip() == "step_1"
    files = sorted(p.name for p in (ck / "step_1").iterdir())
    assert files == ["actor.model.safetensors", "actor.optim.json", "actor.optim.safetensors",
                     "trainer_state.json"]
    state = json.loads((ck / "step_1" / "trainer_state.json").read_text())
    assert state["step"] == 1 and no_timing(state["history"]) == no_timing(history[:1])

    resumed = Trainer(TrainJob.from_dict({**job_dict(), "checkpoint_dir": str(ck),
                                          "save_freq": 1, "resume": True}))
    assert resumed.step == 1
    assert_same_weights(weights(resumed), after1)
    out = resumed.train(progress=False)
    assert len(out) == 2
    assert no_timing(out)[1] == no_timing(history)[1]  # exact: the trainer is deterministic
    assert_same_weights(weights(resumed), after2)      # needs the restored AdamW moments too
    assert (ck / "latest").read_text().strip() == "step_2"
    assert not [p for p in ck.iterdir() if p.name.startswith(".")]


def test_resume_without_a_checkpoint_starts_from_scratch(tmp_path, uninterrupted):
    history, _, _ = uninterrupted
    tr = Trainer(TrainJob.from_dict({**job_dict(trainer={"total_steps": 1}),
                                     "checkpoint_dir": str(tmp_path / "none"), "resume": True}))
    assert tr.step == 0
    assert no_timing(tr.train(progress=False)) == no_timing(history[:1])


@pytest.fixture
def constant_task(monkeypatch):
    """A test-only task whose score is the same for every response: no group has a spread."""
    name = "test-constant-score"
    task = Task(name, lambda rng: "ab=", lambda prompt, response: 0.5, "constant 0.5")
    monkeypatch.setitem(TASKS._items, name, task)
    monkeypatch.setitem(TASKS._canonical, name, name)
    return name


def test_filter_exhaustion_raises_a_clear_error(constant_task):
    job = TrainJob.from_dict(job_dict(
        task=constant_task, trainer={"total_steps": 1},
        algorithm={"filter_groups": {"enable": True, "metric": "score",
                                     "max_num_gen_batches": 2}}))
    tr = Trainer(job)
    with pytest.raises(FilterExhausted) as e:
        tr.train(progress=False)
    msg = str(e.value)
    assert "after 2 generation batches" in msg
    assert "0 of 2 prompt groups" in msg
    assert "max_num_gen_batches" in msg
    assert tr.history == [] and tr.step == 0


def test_filter_disabled_trains_on_zero_spread_groups(constant_task):
    job = TrainJob.from_dict(job_dict(task=constant_task, trainer={"total_steps": 1}))
    (m,) = Trainer(job).train(progress=False)
    assert m["critic/score/mean"] == 0.5 and m["critic/advantages/max"] == 0.0
    assert m["actor/pg_loss"] == 0.0


# ---- TrainJob validation ------------------------------------------------------------------------

@pytest.mark.parametrize("data,key,fragment", [
    ({"bogus": 1}, "bogus", "unknown key"),
    ({"actor": {"entropy_coef": 0.1}}, "actor.entropy_coef", "unknown key"),
    ({"actor": {"optim": {"lrr": 1}}}, "actor.optim.lrr", "unknown key"),
    ({"model": None}, "model", "required"),
    ({"task": None}, "task", "required"),
    ({"model": 3}, "model", "string"),
    ({"task": "nope"}, "task", "unknown task 'nope'"),
    ({"rollout": {"n": "four"}}, "rollout.n", "expected an integer"),
    ({"rollout": {"n": 0}}, "rollout.n", ">= 1"),
    ({"actor": {"calculate_entropy": "yes"}}, "actor.calculate_entropy", "true/false"),
    ({"actor": [1, 2]}, "actor", "expected a mapping"),
    ({"save_freq": "often"}, "save_freq", "integer"),
    ({"save_freq": -1}, "save_freq", "integer >= 0"),
    ({"save_freq": True}, "save_freq", "integer"),
    ({"resume": "yes"}, "resume", "true/false"),
    ({"checkpoint_dir": 5}, "checkpoint_dir", "string"),
    ({"trainer": {"dtype": "float16"}}, "trainer.dtype", "float32"),
])
def test_job_validation_names_file_and_key(data, key, fragment):
    d = job_dict()
    for k, v in data.items():
        if v is None:
            d.pop(k)
        else:
            d[k] = v
    with pytest.raises(InputError) as e:
        TrainJob.from_dict(d, source="train.yaml")
    assert e.value.source == "train.yaml"
    assert e.value.key == key
    msg = str(e.value)
    assert msg.startswith(f"train.yaml: {key}: ")
    assert fragment in msg


def test_unknown_top_level_key_lists_the_job_keys_too():
    with pytest.raises(InputError) as e:
        TrainJob.from_dict({**job_dict(), "modle": "x"}, source="train.yaml")
    for valid in ("model", "task", "checkpoint_dir", "save_freq", "resume", "actor", "rollout"):
        assert valid in str(e.value)


def test_job_top_level_must_be_a_mapping():
    with pytest.raises(InputError, match="train.yaml: expected a mapping"):
        TrainJob.from_dict([1, 2], source="train.yaml")
    with pytest.raises(UnknownNameError):
        TrainJob.from_dict({**job_dict(), "algorithm": {"adv_estimator": "grpoo"}})


@pytest.mark.parametrize("path", sorted((REPO / "examples").glob("train_*.yaml")),
                         ids=lambda p: p.stem)
def test_example_configs_load(path, tmp_path, monkeypatch):
    from rlaudit.cli.train import load_job
    monkeypatch.chdir(tmp_path)
    raw = yaml.safe_load(path.read_text())
    job = load_job(str(path))
    assert Path(job.model).resolve() == MODEL and job.task == raw["task"]
    assert job.config.trainer.total_steps == raw["trainer"]["total_steps"]
    assert job.config.rollout.n == raw["rollout"]["n"]


def test_relative_model_path_resolves_against_the_config_dir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    job = TrainJob.from_dict({**job_dict(), "model": "models/qwen2-tiny"},
                             base_dir=REPO / "scenarios")
    assert Path(job.model) == MODEL


# ---- rlaudit train ----------------------------------------------------------------------------

def test_cli_train_writes_metrics_and_a_loadable_snapshot(tmp_path, capsys):
    cfg = tmp_path / "train.yaml"
    cfg.write_text(yaml.safe_dump(job_dict(trainer={"total_steps": 5})))
    metrics, export = tmp_path / "new" / "m.jsonl", tmp_path / "export"  # dirs created
    rc = main(["train", str(cfg), "--steps", "1", "--quiet", "--metrics-out", str(metrics),
               "--export", str(export)])
    err = capsys.readouterr().err
    assert rc == 0, err
    lines = metrics.read_text().splitlines()
    assert len(lines) == 1  # --steps 1 overrides total_steps: 5
    row = json.loads(lines[0])
    assert row["step"] == 1
    # the same config in-process gives the same step and weights (the CLI adds nothing)
    tr = Trainer(TrainJob.from_dict(job_dict(trainer={"total_steps": 1})))
    (want,) = no_timing(tr.train(progress=False))
    got = {k: v for k, v in row.items() if k != "step" and not k.startswith("timing/")}
    assert got == want
    assert "exported" in err and str(export) in err
    model = load_model(export)
    got_w = {k: v for k, v in model.state_dict().items()}
    assert_same_weights(got_w, weights(tr))
    initial = load_model(MODEL).state_dict()
    assert any(not torch.equal(initial[k], got_w[k]) for k in initial)  # it did train
    assert (export / "config.json").exists()


def test_cli_train_resume(tmp_path, capsys, uninterrupted):
    history, _, _ = uninterrupted
    cfg = tmp_path / "train.yaml"
    cfg.write_text(yaml.safe_dump(job_dict()))
    metrics, ck = tmp_path / "m.jsonl", tmp_path / "ck"
    common = ["train", str(cfg), "--quiet", "--metrics-out", str(metrics),
              "--checkpoint-dir", str(ck)]
    assert main([*common, "--steps", "1"]) == 0
    assert f"checkpoint: {ck / 'step_1'}" in capsys.readouterr().err
    assert main([*common, "--steps", "2", "--resume"]) == 0
    assert f"checkpoint: {ck / 'step_2'}" in capsys.readouterr().err
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r.pop("step") for r in rows] == [1, 2]  # the resumed run wrote only step 2
    assert no_timing(rows) == no_timing(history)


def test_cli_train_resume_needs_a_checkpoint_dir(tmp_path, capsys):
    cfg = tmp_path / "train.yaml"
    cfg.write_text(yaml.safe_dump(job_dict()))
    assert main(["train", str(cfg), "--quiet", "--resume"]) == 2
    assert "--resume" in capsys.readouterr().err
    cfg.write_text(yaml.safe_dump({**job_dict(), "resume": True}))
    assert main(["train", str(cfg), "--quiet"]) == 2
    assert f"{cfg}: resume: " in capsys.readouterr().err


def test_export_of_a_float64_actor_leaves_it_unchanged(tmp_path):
    tr = Trainer(TrainJob.from_dict(job_dict(trainer={"dtype": "float64"})))
    with torch.no_grad():  # values a float32 round trip would change
        for p in tr.actor.model.parameters():
            p.add_(1e-12)
    before = weights(tr)
    tr.export(tmp_path / "snap")
    assert next(tr.actor.model.parameters()).dtype == torch.float64
    assert_same_weights(weights(tr), before)
    loaded = load_model(tmp_path / "snap", dtype=torch.float32).state_dict()
    assert_same_weights(loaded, {k: v.to(torch.float32) for k, v in before.items()})


def test_cli_train_bad_input_exits_2_naming_the_file(tmp_path, capsys):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text(yaml.safe_dump({**job_dict(), "actor": {"entropy_coef": 0.0}}))
    assert main(["train", str(cfg), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert str(cfg) in err and "actor.entropy_coef" in err
    cfg.write_text("model: [unclosed\n")
    assert main(["train", str(cfg), "--quiet"]) == 2
    assert "not valid YAML" in capsys.readouterr().err
    assert main(["train", str(tmp_path / "missing.yaml")]) == 2
    assert "does not exist" in capsys.readouterr().err
    cfg.write_text(yaml.safe_dump(job_dict()))
    assert main(["train", str(cfg), "--steps", "0", "--quiet"]) == 2
    assert "--steps" in capsys.readouterr().err
