"""Loading model folders: errors a user can cause, float64, snapshot ids."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from rlaudit.errors import InputError
from rlaudit.model import tiny
from rlaudit.model.load import load_model, load_tokenizer, snapshot_id, weight_files


@pytest.fixture(scope="module")
def snap(tmp_path_factory):
    return tiny.save_snapshot(tmp_path_factory.mktemp("m") / "llama", "llama", seed=7,
                              num_hidden_layers=1)


@pytest.fixture
def copy(snap, tmp_path):
    dst = tmp_path / "copy"
    shutil.copytree(snap, dst)
    return dst


def _edit_config(folder, **changes):
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(changes)
    (folder / "config.json").write_text(json.dumps(cfg))


def test_missing_folder_names_the_path(tmp_path):
    with pytest.raises(InputError, match=r"nowhere.*does not exist"):
        load_model(tmp_path / "nowhere")
    (tmp_path / "f").write_text("x")
    with pytest.raises(InputError, match="got a file"):
        load_model(tmp_path / "f")


def test_missing_or_malformed_config(copy):
    (copy / "config.json").write_text("{not json")
    with pytest.raises(InputError, match=r"config\.json.*malformed JSON"):
        load_model(copy)
    (copy / "config.json").write_text(json.dumps({"hidden_size": 3}))
    with pytest.raises(InputError, match="model_type"):
        load_model(copy)
    (copy / "config.json").unlink()
    with pytest.raises(InputError, match="missing config.json"):
        load_model(copy)


def test_missing_weights_and_pickles_refused(copy):
    (copy / "model.safetensors").rename(copy / "pytorch_model.bin")
    with pytest.raises(InputError, match=r"no \*\.safetensors.*pytorch_model\.bin.*pickle"):
        load_model(copy)
    with pytest.raises(InputError, match="no \\*\\.safetensors"):
        snapshot_id(copy)


def test_index_naming_a_missing_shard(copy):
    index = {"metadata": {}, "weight_map": {"lm_head.weight": "model-00002-of-00002.safetensors"}}
    (copy / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(InputError, match="model-00002-of-00002"):
        weight_files(copy)


@pytest.mark.parametrize("layers, what", [(2, "missing_keys"), (0, "unexpected_keys")])
def test_weights_not_matching_config_are_an_error(copy, layers, what):
    """HF would silently random-init missing layers or drop extra ones."""
    _edit_config(copy, num_hidden_layers=layers)
    with pytest.raises(InputError, match=what):
        load_model(copy)


def test_mis_shaped_weights_are_an_error(copy):
    _edit_config(copy, intermediate_size=128)
    with pytest.raises(InputError):
        load_model(copy)


def test_float64_load(snap):
    model = load_model(snap, dtype=torch.float64)
    assert {p.dtype for p in model.parameters()} == {torch.float64}
    # float64 models compute in float64 throughout (rlaudit.model.exact): SDPA, not eager
    assert model.config._attn_implementation == "sdpa" and not model.training
    ids = torch.tensor([[257, 1, 2, 3, 200]])
    with torch.no_grad():
        a, b = model(ids).logits, model(ids).logits
    assert a.dtype == torch.float64 and torch.equal(a, b)
    f32 = load_model(snap)
    with torch.no_grad():
        c = f32(ids).logits
    assert (a - c.double()).abs().max() < 1e-3


def test_tokenizer_errors(copy):
    (copy / "tokenizer.json").unlink()
    with pytest.raises(InputError, match="no tokenizer files"):
        load_tokenizer(copy)


def test_snapshot_id(snap, copy, tmp_path):
    sid = snapshot_id(snap)
    assert len(sid) == 16 and int(sid, 16) >= 0
    assert snapshot_id(copy) == sid  # location does not matter
    _edit_config(copy, transformers_version="0.0.1")  # nor who wrote config.json
    assert snapshot_id(copy) == sid
    (copy / "tokenizer_config.json").write_text("{}")  # nor tokenizer files
    assert snapshot_id(copy) == sid
    _edit_config(copy, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    assert snapshot_id(copy) != sid  # but the config does
    other = tiny.save_snapshot(tmp_path / "other", "llama", seed=8, num_hidden_layers=1)
    assert snapshot_id(other) != sid  # and the weights do


def test_snapshot_id_follows_weights_rewritten_in_place(snap, copy):
    """The ids are remembered per process by file stamps: weights overwritten in place (same
    file, same size, other values) get a new id, the id of what is now there."""
    import shutil
    sid = snapshot_id(copy)
    (weights,) = weight_files(copy)
    raw = bytearray(weights.read_bytes())
    raw[-8:] = bytes(8)                  # the last parameter values zeroed, the size unchanged
    with open(weights, "r+b") as f:
        f.write(raw)
    changed = snapshot_id(copy)
    assert changed != sid
    fresh = copy.parent / "fresh"
    shutil.copytree(copy, fresh)         # computed anew from the bytes, elsewhere
    assert snapshot_id(fresh) == changed


def test_qwen2_snapshot_tokenizer_is_not_replaced_by_qwen2_tokenizer():
    """transformers 5's AutoTokenizer would rebuild it with NFC + a word regex + <|endoftext|>."""
    from pathlib import Path

    folder = Path(__file__).resolve().parents[2] / "scenarios" / "models" / "qwen2-tiny"
    tok = load_tokenizer(folder)
    text = "e\u0301 it's"  # NFC would turn e + combining acute into one code point
    assert tok(text, add_special_tokens=False)["input_ids"] == list(text.encode())
    assert len(tok) == 264
