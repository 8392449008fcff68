"""Hostile input, table-driven: config values, rollout values, goldens, command options and the
environment, each an input error (exit 2) naming its file and key -- or its flag or variable --
with no traceback, found before anything replays.

Most cases call the validation functions in-process (one process, no replay); the commands run
in-process through ``rlaudit.cli.main.main`` for the option cases, and a handful through the
real ``rlaudit`` process (:data:`PROCESS_CASES`), where a traceback or a hang would show.
"""

from __future__ import annotations

import json
import os
import resource
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from reltools import (MODEL, REPO, base_tensors, scenario_dict, scenario_with_config, write_rollout,
                      write_scenario)

from rlaudit.data.io import load_rollout
from rlaudit.errors import InputError
from rlaudit.scenarios.golden import read_golden
from rlaudit.scenarios.spec import scenario_from_dict
from rlaudit.scenarios.validate import validate_invocation

NAN, INF = float("nan"), float("inf")
DISTILL = REPO / "scenarios" / "rollouts" / "short-distill.safetensors"
TRAIN_CONFIG = REPO / "examples" / "train_digits_grpo.yaml"


def _raises_named(fn, source, key, fragment=""):
    """``fn()`` raises an InputError naming ``source`` and ``key`` (message has ``fragment``)."""
    with pytest.raises(InputError) as info:
        fn()
    err = info.value
    assert (err.source, err.key) == (None if source is None else str(source), key), str(err)
    assert fragment in str(err), str(err)
    assert "\n" not in str(err), str(err)
    return err


# ---- config values ----------------------------------------------------------------------------

#: (dotted config key, value as a YAML file would give it, key named when different)
CONFIG_CASES = [
    ("actor.grad_clip", NAN, None),
    ("actor.clip_ratio", -0.2, None),             # a negative GRPO/PPO clip epsilon
    ("actor.clip_ratio_low", -0.1, None),
    ("actor.clip_ratio_high", INF, None),
    ("actor.clip_ratio_c", NAN, None),
    ("algorithm.kl_coef", INF, None),
    ("algorithm.kl_coef", "inf", None),           # a numeric string, as YAML reads 1e-6
    ("actor.optim.betas", [0.9, 1.5], "actor.optim.betas[1]"),
    ("actor.optim.betas", [NAN, 0.999], "actor.optim.betas[0]"),
    ("actor.optim.eps", -1e-8, None),
    ("actor.optim.lr", NAN, None),
    ("actor.optim.lr", -0.05, None),
    ("actor.optim.weight_decay", NAN, None),
    ("critic.optim.lr", "nan", None),
    ("algorithm.grpo_std_eps", NAN, None),
    ("algorithm.grpo_std_eps", -1e-6, None),
    ("algorithm.gamma", NAN, None),
    ("algorithm.lam", INF, None),
    ("actor.entropy_coeff", NAN, None),
    ("actor.kl_loss_coef", -1.0, None),
    ("actor.loss_scale_factor", NAN, None),
    ("actor.rollout_correction.rollout_is_threshold", INF, None),
    ("actor.rollout_correction.rollout_kl_loss_coef", NAN, None),
    ("actor.distill.coef", INF, None),
    ("critic.cliprange_value", -0.5, None),
    ("reward.overlong_buffer.penalty_factor", NAN, None),
    ("reward.overlong_buffer.len", 0, None),
    ("rollout.top_k", -5, None),
    ("trainer.seed", -1, None),
]


@pytest.mark.parametrize("key,value,named", CONFIG_CASES,
                         ids=[f"{k}={v!r}" for k, v, _ in CONFIG_CASES])
def test_config_value_outside_its_meaning_is_bad_input(tmp_path, key, value, named):
    path = tmp_path / "scn.yaml"
    _raises_named(lambda: scenario_from_dict(scenario_with_config(key, value), path=path), path,
                  f"config.{named or key}", "expected")


TOLERANCE_CASES = [("default", {"rtol": INF}, "rtol"), ("default", {"atol": INF}, "atol"),
                   ("actor/pg_loss", {"rtol": 1e-6, "atol": ".inf"}, "atol")]


@pytest.mark.parametrize("name,tol,which", TOLERANCE_CASES)
def test_an_infinite_tolerance_is_refused(tmp_path, name, tol, which):
    """An infinite tolerance is legal as a number but passes every golden: refused, named."""
    path = tmp_path / "scn.yaml"
    data = yaml.safe_load(yaml.safe_dump(scenario_dict(tolerances={name: tol})).replace(
        "'.inf'", ".inf"))
    _raises_named(lambda: scenario_from_dict(data, path=path), path, f"tolerances.{name}.{which}",
                  "every comparison pass")


# ---- rollout values ---------------------------------------------------------------------------

def _set(field, index, value):
    def edit(t):
        t[field][index] = value
    return edit


def _reshape(field, fn):
    def edit(t):
        t[field] = fn(t[field]).contiguous()
    return edit


def _widen(t):
    return t.unsqueeze(-1).repeat(*([1] * t.dim()), 2)


#: (id, base rollout, edit(tensors), field named, fragment)
ROLLOUT_CASES = [
    ("response-id-at-vocab", None, _set("response_ids", (0, 0), 264), "response_ids", "[0, 264)"),
    ("response-id-far-above", None, _set("response_ids", (3, 2), 10 ** 9), "response_ids",
     "vocabulary"),
    ("negative-response-id", None, _set("response_ids", (0, 1), -1), "response_ids",
     "vocabulary"),
    ("negative-prompt-id", None, _set("prompt_ids", (1, 2), -5), "prompt_ids", "vocabulary"),
    ("prompt-id-in-padding", None, _set("prompt_ids", (0, -1), 300), "prompt_ids", "vocabulary"),
    ("3d-log-probs", None, _reshape("rollout_log_probs", _widen), "rollout_log_probs", "2-d"),
    ("2d-scores", None, _reshape("scores", _widen), "scores", "1-d"),
    ("2d-uid", None, _reshape("uid", lambda t: t.unsqueeze(-1)), "uid", "1-d"),
    ("3d-response-ids", None, _reshape("response_ids", _widen), "response_ids", "2-d"),
    ("teacher-id-out-of-range", DISTILL, _set("teacher_topk_ids", (0, 0, 1), 264),
     "teacher_topk_ids", "vocabulary"),
    ("negative-teacher-id", DISTILL, _set("teacher_topk_ids", (2, 3, 0), -2),
     "teacher_topk_ids", "vocabulary"),
    ("teacher-topk-2d", DISTILL, _reshape("teacher_topk_ids", lambda t: t[..., 0]),
     "teacher_topk_ids", "3-d"),
    ("teacher-k-mismatch", DISTILL, _reshape("teacher_topk_log_probs", lambda t: t[..., :2]),
     "teacher_topk_log_probs", "teacher_topk_ids"),
]


@pytest.mark.parametrize("base,edit,field,fragment", [c[1:] for c in ROLLOUT_CASES],
                         ids=[c[0] for c in ROLLOUT_CASES])
def test_rollout_value_out_of_range_is_found_before_any_replay(tmp_path, base, edit, field,
                                                               fragment):
    t = ({k: v.clone() for k, v in load_rollout(base).tensors.items()} if base
         else base_tensors())
    edit(t)
    r = write_rollout(tmp_path / "r.safetensors", t)
    scn = write_scenario(tmp_path / "scn.yaml", rollout=str(r))
    _raises_named(lambda: validate_invocation([scn]), r, field, fragment)


# ---- goldens ----------------------------------------------------------------------------------

def _golden(**entry_over) -> dict:
    entry = {"provenance": {"semantics": 1, "config_sha": "x"},
             "steps": [{"actor/pg_loss": {"value": 0.25, "rtol": 1e-6, "atol": 1e-9}}]}
    entry.update(entry_over)
    return {"scenario": "scn", "configs": {}, "backends": {"reference@cpu": entry}}


def _metric(**over) -> dict:
    return _golden(steps=[{"actor/pg_loss": {"value": 0.25, "rtol": 1e-6, "atol": 1e-9, **over}}])


def _no_provenance() -> dict:
    doc = _golden()
    del doc["backends"]["reference@cpu"]["provenance"]
    return doc


METRIC = "backends.reference@cpu.steps[0].actor/pg_loss"
#: (id, file text, key named, fragment)
GOLDEN_CASES = [
    ("deep-array", "[" * 200_000 + "]" * 200_000, None, "nested deeper"),
    ("deep-in-a-value", json.dumps(_metric(value=json.loads("[" * 40 + "]" * 40))), None,
     "nested deeper"),
    ("nan-value", json.dumps(_metric(value=NAN)), f"{METRIC}.value", "finite"),
    ("inf-value", json.dumps(_metric(value=-INF)), f"{METRIC}.value", "finite"),
    ("negative-rtol", json.dumps(_metric(rtol=-1e-6)), f"{METRIC}.rtol", ">= 0"),
    ("negative-atol", json.dumps(_metric(atol=-1.0)), f"{METRIC}.atol", ">= 0"),
    ("infinite-rtol", json.dumps(_metric(rtol=INF)), f"{METRIC}.rtol", "passes every run"),
    ("nan-atol", json.dumps(_metric(atol=NAN)), f"{METRIC}.atol", "finite"),
    ("no-steps", json.dumps(_golden(steps=[])), "backends.reference@cpu.steps", "no steps"),
    ("no-provenance", json.dumps(_no_provenance()), "backends.reference@cpu.provenance",
     "missing"),
]


@pytest.mark.parametrize("text,key,fragment", [c[1:] for c in GOLDEN_CASES],
                         ids=[c[0] for c in GOLDEN_CASES])
def test_malformed_golden_values_are_bad_input(tmp_path, text, key, fragment):
    path = tmp_path / "scn.json"
    path.write_text(text)
    _raises_named(lambda: read_golden(path), path, key, fragment)


def test_every_committed_golden_passes_the_value_checks():
    """Zero false alarms: the shipped goldens are all read as they are."""
    goldens = [p for p in (REPO / "golden").glob("*.json") if not p.name.endswith(".obtained.json")]
    assert goldens
    for p in goldens:
        read_golden(p)


# ---- command options and the environment (in-process commands) --------------------------------

def _file(tmp: Path) -> Path:
    (tmp / "a_file").write_text("x")
    return tmp / "a_file"


def _scn(tmp: Path, **over) -> Path:
    return write_scenario(tmp / "scn.yaml", **over)


def _bad_ids(t: Path) -> Path:
    tensors = base_tensors()
    tensors["response_ids"][2, 0] = 264
    return write_rollout(t / "r.safetensors", tensors)


def _truncated_store(t: Path) -> Path:
    """A report dir whose sqlite store lost its tail (``database disk image is malformed``)."""
    full = t / "full.db"
    con = sqlite3.connect(full)
    con.execute("CREATE TABLE runs (x TEXT)")
    con.executemany("INSERT INTO runs VALUES (?)", [("x" * 500,)] * 2000)
    con.commit()
    con.close()
    (t / "reports").mkdir()
    (t / "reports" / "mlflow.db").write_bytes(full.read_bytes()[:300_000])
    return t / "reports"


#: (id, argv(tmp) -> (argv, env), named: a flag, a variable or (file, key))
OPTION_CASES = [
    ("run-report-dir-is-a-file",
     lambda t: (["run", _scn(t), "--no-mlflow", "--report-dir", _file(t)], {}), "--report-dir"),
    ("run-golden-dir-under-a-file",
     lambda t: (["run", _scn(t), "--no-mlflow", "--golden-dir", _file(t) / "g"], {}),
     "--golden-dir"),
    ("run-timeout-nan", lambda t: (["run", _scn(t), "--no-mlflow", "--timeout", "nan"], {}),
     "--timeout"),
    ("run-timeout-negative", lambda t: (["run", _scn(t), "--no-mlflow", "--timeout", "-3"], {}),
     "--timeout"),
    ("run-reports-env-is-a-file",
     lambda t: (["run", _scn(t), "--no-mlflow"], {"RLAUDIT_REPORTS": str(_file(t))}),
     "--report-dir"),
    ("run-ray-address-nothing-listens",
     lambda t: (["run", _scn(t), "--no-mlflow", "--executor", "ray", "--ray-address",
                 "127.0.0.1:1"], {}), "--ray-address"),
    ("run-ray-address-env",
     lambda t: (["run", _scn(t), "--no-mlflow", "--executor", "ray"],
                {"RAY_ADDRESS": "ray://127.0.0.1:1"}), "RAY_ADDRESS"),
    ("run-ray-address-bad-port",
     lambda t: (["run", _scn(t), "--no-mlflow", "--executor", "ray", "--ray-address",
                 "head:99999"], {}), "--ray-address"),
    ("golden-bless-golden-dir-is-a-file",
     lambda t: (["golden", "bless", _scn(t), "--golden-dir", _file(t)], {}), "--golden-dir"),
    ("report-out-is-a-directory",
     lambda t: (["report", "--out", t, "--report-dir", t / "reports"], {}), "--out"),
    ("report-out-under-a-file",
     lambda t: (["report", "--out", _file(t) / "x.html", "--report-dir", t], {}), "--out"),
    ("run-nan-learning-rate",
     lambda t: (["run", write_scenario(t / "scn.yaml",
                                       scenario_with_config("actor.optim.lr", NAN)),
                 "--no-mlflow", "--report-dir", t / "reports"], {}),
     ("scn.yaml", "config.actor.optim.lr")),
    ("report-truncated-sqlite-store", lambda t: (["report", "--report-dir", _truncated_store(t)],
                                                 {}), "--report-dir"),
    ("train-metrics-out-is-a-directory",
     lambda t: (["train", TRAIN_CONFIG, "--metrics-out", t], {}), "--metrics-out"),
    ("train-export-is-a-file",
     lambda t: (["train", TRAIN_CONFIG, "--export", _file(t)], {}), "--export"),
    ("record-out-under-a-file",
     lambda t: (["record", "--model", MODEL, "--out", _file(t) / "r.safetensors"], {}), "--out"),
    ("record-temperature-nan",
     lambda t: (["record", "--model", MODEL, "--out", t / "r.safetensors", "--temperature",
                 "nan"], {}), "--temperature"),
    ("record-top-p-zero",
     lambda t: (["record", "--model", MODEL, "--out", t / "r.safetensors", "--top-p", "0"], {}),
     "--top-p"),
    ("calibrate-golden-dir-under-a-file",
     lambda t: (["golden", "calibrate", _scn(t), "--golden-dir", _file(t) / "g"], {}),
     "--golden-dir"),
    ("calibrate-rollout-id-past-the-vocabulary",
     lambda t: (["golden", "calibrate", _scn(t, rollout=str(_bad_ids(t)))], {}),
     ("r.safetensors", "response_ids")),
    ("fuzz-report-dir-is-a-file",
     lambda t: (["fuzz", "--target", "any:Adapter", "--report-dir", _file(t)], {}),
     "--report-dir"),
    ("fuzz-found-dir-is-a-file",
     lambda t: (["fuzz", "--target", "any:Adapter", "--found-dir", _file(t),
                 "--report-dir", t / "reports"], {}), "--found-dir"),
    ("run-golden-env-is-a-file",
     lambda t: (["run", _scn(t), "--no-mlflow"], {"RLAUDIT_GOLDEN": str(_file(t))}),
     "--golden-dir"),
]
#: cases that already exited 2 before the checks of this file: kept so that they keep holding
HELD_OPTION_CASES = [
    ("held-run-jobs-zero",
     lambda t: (["run", _scn(t), "--no-mlflow", "--jobs", "0"], {}), "--jobs"),
    ("held-report-dir-is-a-file", lambda t: (["report", "--report-dir", _file(t)], {}),
     "--report-dir"),
    ("held-env-threads-zero", lambda t: (["run", _scn(t), "--no-mlflow", "--report-dir",
                                          t / "reports"], {"RLAUDIT_THREADS": "0"}),
     "RLAUDIT_THREADS"),
    ("held-env-forward-memo", lambda t: (["run", _scn(t), "--no-mlflow", "--report-dir",
                                          t / "reports"], {"RLAUDIT_FORWARD_MEMO": "maybe"}),
     "RLAUDIT_FORWARD_MEMO"),
]


@pytest.mark.parametrize("make,named", [c[1:] for c in OPTION_CASES + HELD_OPTION_CASES],
                         ids=[c[0] for c in OPTION_CASES + HELD_OPTION_CASES])
def test_command_options_and_environment_exit_2_naming_them(cli, tmp_path, monkeypatch, make,
                                                           named):
    for var in ("RAY_ADDRESS", "MLFLOW_TRACKING_URI", "RLAUDIT_REPORTS", "RLAUDIT_GOLDEN"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.chdir(tmp_path)  # the default golden/ and reports/ are the test's own
    argv, env = make(tmp_path)
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    res = cli(*argv)
    assert res.rc == 2, res.err
    assert "Traceback" not in res.err and "running" not in res.err, res.err
    lines = [ln for ln in res.err.splitlines() if ln.startswith("rlaudit:")]
    assert len(lines) == 1, res.err
    where = f"{named}:" if isinstance(named, str) else f"{named[0]}: {named[1]}:"
    assert where in lines[0], res.err
    assert res.seconds < 10, res.seconds
    assert not (tmp_path / "golden").exists()


def test_a_path_error_anywhere_in_a_command_is_a_message_not_a_traceback(cli, monkeypatch):
    """The last net under every command: an OSError about a path (one no option check foresaw)
    ends in one line naming the path, exit 2."""
    import rlaudit.cli.list_cmd as list_cmd

    def unreadable(args):
        raise PermissionError(13, "Permission denied", "/srv/scenarios/locked.yaml")
    monkeypatch.setattr(list_cmd, "run", unreadable)
    res = cli("list")
    assert res.rc == 2 and "Traceback" not in res.err
    assert res.err.strip() == "rlaudit: /srv/scenarios/locked.yaml: Permission denied"


# ---- the real process: no traceback, no hang --------------------------------------------------

def _corrupt_store(t: Path) -> list:
    (t / "reports").mkdir()
    (t / "reports" / "mlflow.db").write_bytes(b"SQLite format 3\x00" + b"\x00" * 80)
    return ["report", "--report-dir", t / "reports"]


def _deep_golden(t: Path) -> list:
    (t / "golden").mkdir()
    (t / "golden" / "scn.json").write_text("[" * 100_000 + "]" * 100_000)
    return ["run", _scn(t), "--no-mlflow", "--golden-dir", t / "golden", "--report-dir",
            t / "reports"]


#: (id, argv(tmp), what the one-line message names)
PROCESS_CASES = [
    ("report-corrupt-sqlite-store", _corrupt_store, "--report-dir"),
    ("report-out-is-a-directory", lambda t: ["report", "--out", t, "--report-dir", t], "--out"),
    ("run-report-dir-is-a-file", lambda t: ["run", _scn(t), "--report-dir", _file(t)],
     "--report-dir"),
    ("run-ray-address-nothing-listens",
     lambda t: ["run", _scn(t), "--executor", "ray", "--ray-address", "127.0.0.1:1"],
     "--ray-address: cannot reach a Ray cluster at 127.0.0.1:1"),
    ("run-deeply-nested-golden", _deep_golden, "scn.json: nested deeper"),
]


@pytest.mark.parametrize("make,named", [c[1:] for c in PROCESS_CASES],
                         ids=[c[0] for c in PROCESS_CASES])
def test_the_real_command_ends_in_one_line_and_exit_2_within_10_s(tmp_path, make, named):
    """Alone these take 0.3-5 s of wall time. A hang (the issue's Ray case: over 300 s) fails on the
    60 s timeout; the 10 s is asserted on the process's CPU time, which a loaded CI machine
    sharing its cores does not stretch the way it stretches wall time."""
    argv = [str(a) for a in make(tmp_path)]
    env = {k: v for k, v in os.environ.items()
           if k not in ("RAY_ADDRESS", "MLFLOW_TRACKING_URI", "RLAUDIT_REPORTS")}
    env["PYTHONPATH"] = f"{REPO}{os.pathsep}{env.get('PYTHONPATH', '')}"
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    p = subprocess.run([sys.executable, "-m", "rlaudit.cli.main", *argv], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=60)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    seconds = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    assert p.returncode == 2, p.stderr
    assert "Traceback" not in p.stderr, p.stderr
    lines = [ln for ln in p.stderr.splitlines() if ln.startswith("rlaudit:")]
    assert len(lines) == 1 and named in lines[0], p.stderr
    assert seconds < 10, seconds
    assert not (tmp_path / "reports" / "latest").exists()


def test_the_table_is_at_least_60_cases():
    """The issue's floor, counting only the cases that did not hold before this table."""
    cases = (CONFIG_CASES, TOLERANCE_CASES, ROLLOUT_CASES, GOLDEN_CASES, OPTION_CASES,
             PROCESS_CASES)
    assert sum(map(len, cases)) >= 60


def test_vocab_is_the_models():
    """The committed model's vocabulary is what the rollout cases assume (264 ids)."""
    assert json.loads((MODEL / "config.json").read_text())["vocab_size"] == 264
    assert int(base_tensors()["response_ids"].max()) < 264
