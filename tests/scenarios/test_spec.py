"""Scenario files: every committed one loads and says what its YAML says; every malformed one is an
InputError naming the file and the key, and `rlaudit run bad.yaml` exits 2 naming the file."""

from __future__ import annotations

import copy
import os
from pathlib import Path

import pytest
import yaml

from rlaudit.cli.main import main
from rlaudit.dicts import flatten, to_dict
from rlaudit.errors import InputError
from rlaudit.scenarios.spec import discover, load_scenario
from rlaudit.verdict.tolerance import Tolerance

REPO = Path(__file__).resolve().parents[2]
SCENARIOS = REPO / "scenarios"
MODEL = SCENARIOS / "models" / "qwen2-tiny-short"
ROLLOUT = SCENARIOS / "rollouts" / "short-ref.safetensors"
COMMITTED = sorted(SCENARIOS.glob("*.yaml"))

#: a valid scenario every bad case below changes in one place
BASE = {
    "description": "tiny",
    "model": str(MODEL),
    "rollout": str(ROLLOUT),
    "steps": 1,
    "dtype": "float64",
    "config": {"rollout": {"n": 4, "response_length": 12},
               "actor": {"ppo_mini_batch_size": 2, "ppo_micro_batch_size_per_gpu": 2}},
    "backends": {"reference": {}},
    "invariants": ["sanity-bounds"],
}


def test_there_are_38_committed_scenarios():
    assert len(COMMITTED) == 38
    assert discover(SCENARIOS) == COMMITTED  # models/ and rollouts/ hold no scenarios


@pytest.mark.parametrize("path", COMMITTED, ids=lambda p: p.stem)
def test_committed_scenario_loads_as_written(path):
    raw = yaml.safe_load(path.read_text())
    scn = load_scenario(path)
    assert scn.name == raw.get("name", path.stem)
    assert scn.path == path
    assert (scn.model / "config.json").is_file()
    assert scn.rollout.is_file() and scn.rollout.with_suffix(".json").is_file()
    assert scn.model == (path.parent / raw["model"]).resolve()
    assert list(scn.backends) == list(raw.get("backends", {"reference": {}}))
    for b, layout in raw.get("backends", {}).items():
        assert scn.backends[b] == (layout or {})
    assert scn.invariants == list(dict.fromkeys(raw["invariants"]))
    assert scn.steps == raw.get("steps", 1)
    assert scn.dtype == raw.get("dtype", "float64")
    assert scn.config.trainer.dtype == scn.dtype
    # every value the YAML sets reached the config tree
    loaded = flatten(to_dict(scn.config))
    for key, value in flatten(raw.get("config") or {}).items():
        want = list(value) if isinstance(value, tuple) else value
        assert loaded[key] == want, key
    assert scn.description == (raw.get("description") or "").strip()


def test_relative_paths_resolve_against_the_scenario_file(tmp_path, monkeypatch):
    sub = tmp_path / "deep" / "dir"
    sub.mkdir(parents=True)
    data = {**BASE, "model": os.path.relpath(MODEL, sub), "rollout": os.path.relpath(ROLLOUT, sub)}
    (sub / "rel.yaml").write_text(yaml.safe_dump(data))
    monkeypatch.chdir(tmp_path)  # not the scenario's directory
    scn = load_scenario(Path("deep/dir/rel.yaml"))
    assert scn.model == MODEL and scn.rollout == ROLLOUT
    assert scn.name == "rel"


def test_tolerance_lookup_order(tmp_path):
    p = tmp_path / "tol.yaml"
    p.write_text(yaml.safe_dump({**BASE, "tolerances": {
        "default": {"rtol": 0.5}, "actor/pg_loss": {"atol": "1e-3"}}}))
    scn = load_scenario(p)
    assert scn.tol("actor/pg_loss") == Tolerance(rtol=0.0, atol=1e-3)  # YAML string 1e-3 accepted
    assert scn.tol("actor/entropy") == Tolerance(rtol=0.5, atol=0.0)
    p.write_text(yaml.safe_dump({**BASE, "dtype": "float32"}))
    t = load_scenario(p).tol("actor/entropy")  # no entry, no default: by dtype, looser in fp32
    p.write_text(yaml.safe_dump(BASE))
    t64 = load_scenario(p).tol("actor/entropy")
    assert t.rtol > t64.rtol and t.atol > t64.atol
    assert Tolerance(rtol=0.1, atol=0.01).close(1.1 + 0.009, 1.1)
    assert not Tolerance(rtol=0.1, atol=0.01).close(1.1 + 0.13, 1.1)


def _set(d: dict, dotted: str, value) -> None:
    *parents, last = dotted.split(".")
    for p in parents:
        d = d.setdefault(p, {})
    if value is _DELETE:
        d.pop(last)
    else:
        d[last] = value


_DELETE = object()

#: (id, changes {dotted key: value or _DELETE}, expected InputError key, message fragment)
BAD = [
    ("unknown-top-key", {"invariant": ["x"]}, "invariant", "unknown key"),
    ("missing-model-key", {"model": _DELETE}, "model", "required"),
    ("missing-rollout-key", {"rollout": _DELETE}, "rollout", "required"),
    ("missing-invariants", {"invariants": _DELETE}, "invariants", "required"),
    ("unknown-config-key", {"config.actor.entropy_coef": 0.1}, "config.actor.entropy_coef",
     "unknown key"),
    ("unknown-config-section", {"config.actr": {}}, "config.actr", "unknown key"),
    ("config-bad-float", {"config.actor.entropy_coeff": "lots"}, "config.actor.entropy_coeff",
     "expected a number"),
    ("config-bad-int", {"config.rollout.n": 1.5}, "config.rollout.n", "expected an integer"),
    ("config-bad-bool", {"config.actor.calculate_entropy": "yes"},
     "config.actor.calculate_entropy", "true/false"),
    ("config-bad-range", {"config.actor.clip_ratio_c": 0.5}, "config.actor.clip_ratio_c", "> 1"),
    ("config-unknown-name", {"config.actor.loss_agg_mode": "token-means"},
     "config.actor.loss_agg_mode", "token-means"),
    ("config-not-mapping", {"config": [1, 2]}, "config", "mapping"),
    ("config-string", {"config": "actor"}, "config", "mapping"),
    ("config-trainer-not-mapping", {"config.trainer": [1]}, "config.trainer", "mapping"),
    ("steps-zero", {"steps": 0}, "steps", "integer >= 1"),
    ("steps-string", {"steps": "2"}, "steps", "integer >= 1"),
    ("steps-bool", {"steps": True}, "steps", "integer >= 1"),
    ("dtype", {"dtype": "float16"}, "dtype", "float64"),
    ("device", {"device": "tpu"}, "device", "cpu or cuda"),
    ("unknown-backend", {"backends": {"reference": {}, "deepspeed": {}}}, "backends.deepspeed",
     "unknown backend"),
    ("no-backends", {"backends": {}}, "backends", "non-empty mapping"),
    ("backends-list", {"backends": ["reference"]}, "backends", "mapping"),
    ("layout-key", {"backends": {"fsdp": {"tp": 2}}}, "backends.fsdp.tp", "unknown layout key"),
    ("layout-key-reference", {"backends": {"reference": {"dp": 1}}}, "backends.reference.dp",
     "unknown layout key"),
    ("layout-zero", {"backends": {"fsdp": {"dp": 0}}}, "backends.fsdp.dp", "integer >= 1"),
    ("layout-string", {"backends": {"megatron": {"tp": "2"}}}, "backends.megatron.tp",
     "integer >= 1"),
    ("layout-bool", {"backends": {"megatron": {"pp": True}}}, "backends.megatron.pp",
     "integer >= 1"),
    ("layout-list", {"backends": {"fsdp": [2]}}, "backends.fsdp", "mapping"),
    ("unknown-invariant", {"invariants": ["sanity-bounds", "no-such-check"]}, "invariants[1]",
     "no-such-check"),
    ("invariants-empty", {"invariants": []}, "invariants", "non-empty list"),
    ("invariants-string", {"invariants": "sanity-bounds"}, "invariants", "list"),
    ("model-missing-dir", {"model": "/nonexistent/rlaudit-model"}, "model", "no config.json"),
    ("model-not-string", {"model": 3}, "model", "path string"),
    ("rollout-missing-file", {"rollout": "/nonexistent/r.safetensors"}, "rollout",
     "does not exist"),
    ("ref-model-missing", {"ref_model": "/nonexistent/ref"}, "ref_model", "no config.json"),
    ("tolerances-negative", {"tolerances": {"default": {"rtol": -1}}}, "tolerances.default.rtol",
     ">= 0"),
    ("tolerances-string", {"tolerances": {"actor/pg_loss": {"atol": "tight"}}},
     "tolerances.actor/pg_loss.atol", ">= 0"),
    ("tolerances-unknown-field", {"tolerances": {"default": {"rel": 1e-3}}}, "tolerances.default",
     "rtol and/or atol"),
    ("tolerances-empty-entry", {"tolerances": {"default": {}}}, "tolerances.default",
     "rtol and/or atol"),
    ("tolerances-list", {"tolerances": [1e-3]}, "tolerances", "mapping"),
    ("tolerances-nan", {"tolerances": {"default": {"atol": float("nan")}}},
     "tolerances.default.atol", ">= 0"),
    ("tags", {"tags": "seed"}, "tags", "list of strings"),
    ("description", {"description": ["a"]}, "description", "string"),
    ("name-empty", {"name": ""}, "name", "non-empty"),
    ("name-path", {"name": "../escape"}, "name", "no path separators"),
]


def _write_bad(tmp_path: Path, changes: dict) -> Path:
    data = copy.deepcopy(BASE)
    for k, v in changes.items():
        if "." in k and k.startswith("config."):
            _set(data, k, v)
        elif v is _DELETE:
            data.pop(k)
        else:
            data[k] = v
    p = tmp_path / "bad.yaml"
    p.write_text(yaml.safe_dump(data))
    return p


@pytest.mark.parametrize("changes,key,fragment", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_scenario_names_file_and_key(tmp_path, changes, key, fragment):
    path = _write_bad(tmp_path, changes)
    with pytest.raises(InputError) as e:
        load_scenario(path)
    assert e.value.source == str(path)
    assert e.value.key == key
    msg = str(e.value)
    assert msg.startswith(f"{path}: {key}: "), msg
    assert fragment in msg


@pytest.mark.parametrize("text", [
    b"model: [unclosed\n",
    b"invariants: [a\n  b: c\n",
    b"\xff\xfe\x00\x01 not text",
    b"- a list\n- not a mapping\n",
    b"",
], ids=["unclosed", "bad-indent", "binary", "list", "empty"])
def test_unparseable_file_names_the_file(tmp_path, text):
    path = tmp_path / "broken.yaml"
    path.write_bytes(text)
    with pytest.raises(InputError) as e:
        load_scenario(path)
    assert e.value.source == str(path)
    assert str(e.value).startswith(f"{path}: ")


def test_missing_scenario_file(tmp_path):
    with pytest.raises(InputError, match="does not exist") as e:
        load_scenario(tmp_path / "nope.yaml")
    assert e.value.source == str(tmp_path / "nope.yaml")


CLI_CASES = [b for b in BAD if b[0] in {
    "unknown-top-key", "unknown-config-key", "config-bad-float", "config-not-mapping",
    "unknown-backend", "layout-key", "layout-zero", "unknown-invariant", "model-missing-dir",
    "rollout-missing-file", "tolerances-negative", "name-path"}]


@pytest.mark.parametrize("changes,key", [b[1:3] for b in CLI_CASES],
                         ids=[b[0] for b in CLI_CASES])
def test_cli_run_bad_scenario_exits_2_naming_file_and_key(tmp_path, capsys, changes, key):
    path = _write_bad(tmp_path, changes)
    rc = main(["run", str(path), "--no-mlflow", "--report-dir", str(tmp_path / "reports"),
               "--golden-dir", str(tmp_path / "golden")])
    out, err = capsys.readouterr()
    assert rc == 2
    assert f"{path}: {key}: " in err
    assert not (tmp_path / "golden").exists() and not (tmp_path / "reports").exists()


def test_cli_run_malformed_yaml_exits_2(tmp_path, capsys):
    path = tmp_path / "broken.yaml"
    path.write_bytes(b"\xff\xfe binary")
    assert main(["run", str(path), "--no-mlflow", "--report-dir", str(tmp_path)]) == 2
    assert str(path) in capsys.readouterr().err
    path.write_text("model: [unclosed\n")
    assert main(["run", str(path), "--no-mlflow", "--report-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert str(path) in err and "not valid YAML" in err
