"""Bad input of every kind exits 2 before anything runs, naming the file and the key.

The first block are the 17 kinds of bad input that already held when issue #13 was filed (they
must keep holding); the rest are what the up-front validation pass adds: goldens, model
snapshots, layouts against the model, several bad scenarios reported together, and the issue's
case 4 (an impossible megatron layout, caught in seconds even with ``--backend reference``).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from reltools import (MODEL, ROLLOUT, assert_named, base_tensors, scenario_dict,
                      scenario_with_config, write_rollout, write_scenario)


def _copy_rollout(tmp: Path) -> Path:
    dst = tmp / "rollouts" / "r.safetensors"
    dst.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(ROLLOUT, dst)
    shutil.copy(ROLLOUT.with_suffix(".json"), dst.with_suffix(".json"))
    return dst


def _with_rollout(tmp: Path, edit) -> tuple[Path, Path]:
    """A scenario on a copy of the committed rollout after ``edit(tensors)`` (hashes matching)."""
    t = base_tensors()
    edit(t)
    r = write_rollout(tmp / "rollouts" / "r.safetensors", t)
    return write_scenario(tmp / "scn.yaml", rollout=str(r)), r


def _scn_key(**over):
    """A scenario with ``over`` applied: the error names the scenario file."""
    def make(tmp):
        scn = write_scenario(tmp / "scn.yaml", **over)
        return scn, scn
    return make


def _scn_data(data):
    def make(tmp):
        scn = write_scenario(tmp / "scn.yaml", data)
        return scn, scn
    return make


def _yaml_text(text):
    def make(tmp):
        p = tmp / "scn.yaml"
        p.write_text(text)
        return p, p
    return make


def _bytes(how):
    def make(tmp):
        r = _copy_rollout(tmp)
        data = bytearray(r.read_bytes())
        if how == "truncated":
            data = data[: len(data) // 2]
        else:  # one byte of tensor data flipped
            data[-3] ^= 0xFF
        r.write_bytes(bytes(data))
        return write_scenario(tmp / "scn.yaml", rollout=str(r)), r
    return make


def _sidecar(how):
    def make(tmp):
        r = _copy_rollout(tmp)
        side = r.with_suffix(".json")
        if how == "missing":
            side.unlink()
        elif how == "malformed":
            side.write_text("{not json")
        return write_scenario(tmp / "scn.yaml", rollout=str(r)), side
    return make


def _tensors(edit):
    def make(tmp):
        return _with_rollout(tmp, edit)
    return make


def _nan(t):
    t["rollout_log_probs"][0, 0] = float("nan")


def _mask_shape(t):
    t["response_mask"] = t["response_mask"][:, :-1].clone()


def _no_uid(t):
    del t["uid"]


def _mask_past_length(t):
    row = int(torch.argmin(t["response_lengths"]))
    t["response_mask"][row, -1] = True


#: (id, make(tmp) -> (scenario, which file is named), key named, fragment of the message)
ALREADY_HELD = [
    ("malformed-yaml", _yaml_text("model: [unclosed\n"), None, "not valid YAML"),
    ("unknown-top-key", _scn_key(backend={}), "backend", "unknown key"),
    ("unknown-config-key", _scn_data(scenario_with_config("actor.entropy_coef", 0.1)),
     "config.actor.entropy_coef", "unknown key"),
    ("wrong-type-steps", _scn_key(steps="two"), "steps", "integer"),
    ("wrong-type-config", _scn_data(scenario_with_config("actor.optim.lr", "fast")),
     "config.actor.optim.lr", "expected"),
    ("unknown-invariant", _scn_key(invariants=["sanity-bound"]), "invariants[0]", "sanity-bounds"),
    ("unknown-layout-key", _scn_key(backends={"reference": {}, "fsdp": {"tp": 2}}),
     "backends.fsdp.tp", "unknown layout key"),
    ("missing-model", _scn_key(model="/nonexistent/model"), "model", "no config.json"),
    ("truncated-safetensors", _bytes("truncated"), None, "truncated or corrupt"),
    # the flipped byte is in the last tensor of the file's data area: response_mask
    ("tampered-safetensors", _bytes("tampered"), "response_mask", "sha256 mismatch"),
    ("missing-sidecar", _sidecar("missing"), None, "missing sidecar"),
    ("malformed-sidecar", _sidecar("malformed"), None, "not valid JSON"),
    ("nan-log-probs", _tensors(_nan), "rollout_log_probs", "non-finite"),
    ("mis-shaped-mask", _tensors(_mask_shape), "response_mask", "expected shape"),
    ("missing-field", _tensors(_no_uid), "uid", "required field is missing"),
    ("mask-past-length", _tensors(_mask_past_length), "response_mask", "past response_lengths"),
    ("temperature-mismatch", _scn_data(scenario_with_config("rollout.temperature", 0.7)),
     "config.rollout.temperature", "sampled at temperature 1.0"),
]


def _check_exit_2(cli, tmp, scn, source, key, fragment, *extra):
    """``rlaudit run scn`` exits 2 naming ``source`` (and ``key``) with ``fragment``, having run
    and written nothing."""
    res = cli(*_run(scn, tmp, *extra))
    assert res.rc == 2, res.err
    if key is None:
        assert f"{source}:" in res.err and "Traceback" not in res.err, res.err
    else:
        assert_named(res.err, source, key)
    assert fragment in res.err
    assert "running" not in res.err  # nothing ran ...
    assert not (tmp / "reports").exists() and not (tmp / "golden").exists()  # ... or was written
    return res


def _run(scn, tmp, *extra):
    return ["run", scn, "--golden-dir", tmp / "golden", "--report-dir", tmp / "reports",
            "--no-mlflow", *extra]


@pytest.mark.parametrize("make,key,fragment", [c[1:] for c in ALREADY_HELD],
                         ids=[c[0] for c in ALREADY_HELD])
def test_bad_input_that_already_held_exits_2(cli, tmp_path, make, key, fragment):
    scn, source = make(tmp_path)
    _check_exit_2(cli, tmp_path, scn, source, key, fragment)


# ---- what the validation pass adds ------------------------------------------------------------

def test_malformed_golden_is_found_before_anything_runs(cli, tmp_path):
    scn = write_scenario(tmp_path / "scn.yaml")
    gdir = tmp_path / "golden"
    gdir.mkdir()
    bad = {"scenario": "scn", "backends": {"reference@cpu": {"steps": [
        {"actor/pg_loss": {"value": "x", "rtol": 0, "atol": 0}}]}}}
    (gdir / "scn.json").write_text(json.dumps(bad))
    before = (gdir / "scn.json").read_bytes()
    res = cli(*_run(scn, tmp_path))
    assert res.rc == 2 and "running" not in res.err
    assert_named(res.err, gdir / "scn.json", "backends.reference@cpu.steps[0].actor/pg_loss.value")
    (gdir / "scn.json").write_text("{not json")
    res = cli(*_run(scn, tmp_path))
    assert res.rc == 2 and f"{gdir / 'scn.json'}: golden file is not valid JSON" in res.err
    (gdir / "scn.json").write_bytes(before)
    assert not (tmp_path / "reports").exists()


def test_truncated_model_weights_name_the_scenario_key_and_the_file(cli, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(MODEL, model)
    w = model / "model.safetensors"
    w.write_bytes(w.read_bytes()[:-1000])
    scn = write_scenario(tmp_path / "scn.yaml", model=str(model))
    res = _check_exit_2(cli, tmp_path, scn, scn, "model", "not a complete safetensors file")
    assert str(w) in res.err


def test_unknown_backend_option_exits_2(cli, tmp_path):
    scn = write_scenario(tmp_path / "scn.yaml")
    res = cli(*_run(scn, tmp_path, "--backend", "deepspeed"))
    assert res.rc == 2 and "--backend: unknown backend 'deepspeed'" in res.err


def test_case4_impossible_megatron_layout_is_named_in_seconds_even_for_reference(cli, tmp_path):
    """Issue case 4: tp=3 on 4 heads / 2 KV heads failed after 105 s naming config.json (no
    path), and passed with --backend reference. Now: exit 2 before anything runs, naming the
    scenario file, backends.megatron.tp and the model's config.json with its key."""
    scn = write_scenario(tmp_path / "tp3.yaml",
                         backends={"reference": {}, "megatron": {"tp": 3}})
    for extra in ((), ("--backend", "reference")):
        res = _check_exit_2(cli, tmp_path, scn, scn, "backends.megatron.tp",
                            "num_key_value_heads 2 is not divisible by tp=3", *extra)
        assert str(MODEL / "config.json") in res.err
        assert res.seconds < 30  # validation only: nothing is spawned


def test_several_bad_scenarios_are_reported_together_and_nothing_runs(cli, tmp_path):
    """Issue case 3, up-front half: bad files among good scenarios end the invocation at once,
    every problem listed (each with its file and key), before the first replay."""
    good = write_scenario(tmp_path / "a_good.yaml")
    t = base_tensors()
    t["rollout_log_probs"][1, 2] = float("inf")
    bad_rollout = write_rollout(tmp_path / "rollouts" / "inf.safetensors", t)
    bad_data = write_scenario(tmp_path / "b_bad_data.yaml", rollout=str(bad_rollout))
    bad_layout = write_scenario(tmp_path / "c_bad_layout.yaml",
                                backends={"reference": {}, "megatron": {"tp": 1, "pp": 3}})
    bad_key = write_scenario(tmp_path / "d_bad_key.yaml", steps=0)
    res = cli("run", good, bad_data, bad_layout, bad_key, *_run(good, tmp_path)[2:])
    assert res.rc == 2
    assert "4 input problems; nothing was run" not in res.err  # three, not four
    assert "3 input problems; nothing was run" in res.err
    assert_named(res.err, bad_rollout, "rollout_log_probs")
    assert_named(res.err, bad_layout, "backends.megatron.pp")
    assert_named(res.err, bad_key, "steps")
    assert "running" not in res.err and not (tmp_path / "reports").exists()


def test_a_target_whose_stage_cannot_take_the_contracts_arguments_exits_2(cli, tmp_path,
                                                                         monkeypatch):
    """Adapter signatures are checked before any stage check runs (`rlaudit run --target`)."""
    (tmp_path / "my_adapter_rel.py").write_text(
        "class Adapter:\n"
        "    name = 'mine'\n"
        "    def kl_penalty(self, *, log_prob, ref_log_prob, kind):\n"
        "        return log_prob - ref_log_prob\n"
        "    def compute_advantages(self, *, estimator, token_level_rewards, response_mask):\n"
        "        raise AssertionError('never called')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    bad_scn = write_scenario(tmp_path / "scn" / "bad.yaml", steps=0)
    res = cli("run", "--target", "my_adapter_rel:Adapter", "bad", "--scenarios-dir",
              tmp_path / "scn", "--no-mlflow", "--report-dir", tmp_path / "reports")
    assert res.rc == 2, res.err
    assert "2 input problems; nothing was run" in res.err
    assert_named(res.err, "my_adapter_rel:Adapter", "compute_advantages")
    assert "unexpected keyword argument 'uid'" in res.err
    assert_named(res.err, bad_scn, "steps")
    assert "kl_penalty" not in res.err  # a stage that fits the contract is not named
    assert not (tmp_path / "reports").exists()


def test_the_stage_contract_is_read_for_every_stage():
    """The signatures checked are those of the Stages protocol, one per stage (a stage missing
    from it must not silently switch the check off)."""
    from rlaudit.targets.contract.adapter import STAGES
    from rlaudit.targets.run.validate import stage_contract
    contract = stage_contract()
    assert set(contract) == set(STAGES)
    assert contract["make_microbatches"] == (["batch"], ["dp_size"])
    assert "norm_adv_by_std_in_grpo" in contract["compute_advantages"][1]
    assert all(pos or kw for pos, kw in contract.values())
