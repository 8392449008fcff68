"""Fixed-rollout files: round trip, canonical hash, and every corruption named by file and field."""

from __future__ import annotations

import hashlib
import json
import os
import struct

import pytest
import safetensors.torch
import torch

from rlaudit.data import io as rio
from rlaudit.data.batch import Kind, RolloutBatch
from rlaudit.data.io import load_rollout, rollout_sha256, save_rollout, sidecar_path
from rlaudit.errors import InputError


def make_batch() -> RolloutBatch:
    """3 rows, P=3, R=4, with int64, int32, bool, float32, float64, bf16 and a [B, R, K] field."""
    g = torch.Generator().manual_seed(1)
    resp_len = torch.tensor([4, 0, 2])
    mask = torch.tensor([[1, 0, 1, 1], [0, 0, 0, 0], [1, 1, 0, 0]], dtype=torch.bool)
    return RolloutBatch.from_tensors({
        "prompt_ids": torch.tensor([[5, 6, 0], [7, 0, 0], [5, 6, 9]]),
        "prompt_lengths": torch.tensor([2, 1, 3]),
        "response_ids": torch.randint(0, 50, (3, 4), generator=g),
        "response_lengths": resp_len,
        "response_mask": mask,
        "uid": torch.tensor([2**62, -3, 2**62]),
        "scores": torch.tensor([1.0, 0.0, 0.5], dtype=torch.float64),
        "rollout_log_probs": (-torch.rand(3, 4, generator=g)).to(torch.bfloat16),
        "old_log_probs": -torch.rand(3, 4, generator=g, dtype=torch.float32),
        "teacher_topk_log_probs": -torch.rand(3, 4, 2, generator=g, dtype=torch.float64),
        "attempt": torch.tensor([0, 1, 2], dtype=torch.int32),
        "prompt_is_system": torch.tensor([[1, 0, 0], [0, 0, 0], [1, 1, 0]], dtype=torch.bool),
    }, kinds={"attempt": "seq", "prompt_is_system": "prompt"}, meta={"engine": "test", "n": 2})


def raw_bytes(t: torch.Tensor) -> bytes:
    """Little-endian C-order bytes via numpy (bf16 through its int16 bit pattern)."""
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().astype("<i2").tobytes()
    arr = t.numpy()
    return arr.astype(arr.dtype.newbyteorder("<")).tobytes()


def canonical_sha(tensors) -> str:
    """The documented hash: per sorted field, json [name, dtype, shape, nbytes] + "\\n", bytes."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        raw = raw_bytes(t)
        dtype = str(t.dtype).split(".")[-1]
        h.update((json.dumps([name, dtype, list(t.shape), len(raw)]) + "\n").encode())
        h.update(raw)
    return h.hexdigest()


def _one(name, t) -> str:
    """sha256 of one field's record (header line + bytes)."""
    raw = raw_bytes(t.contiguous())
    header = json.dumps([name, str(t.dtype).split(".")[-1], list(t.shape), len(raw)]) + "\n"
    return hashlib.sha256(header.encode() + raw).hexdigest()


def rewrite(path, tensors, edit_sidecar=None):
    """Replace the tensors file and re-hash the sidecar consistently (bypassing save_rollout's
    validation), so that only the defect under test remains."""
    safetensors.torch.save_file(tensors, str(path))
    side = json.loads(sidecar_path(path).read_text())
    side["fields"] = {k: {"kind": side["fields"].get(k, {"kind": "seq"})["kind"],
                          "dtype": str(t.dtype).split(".")[-1], "shape": list(t.shape),
                          "sha256": _one(k, t)} for k, t in tensors.items()}
    side["sha256"] = canonical_sha(tensors)
    if edit_sidecar:
        edit_sidecar(side)
    sidecar_path(path).write_text(json.dumps(side))


@pytest.fixture
def saved(tmp_path):
    batch = make_batch()
    path = tmp_path / "roll.safetensors"
    save_rollout(batch, path, meta={"n": 4, "model": "tiny@abc"})
    return batch, path


def test_round_trip_all_dtypes_and_sidecar(saved):
    batch, path = saved
    loaded = load_rollout(path)
    assert set(loaded.keys()) == set(batch.keys())
    for k in batch.keys():
        assert loaded[k].dtype == batch[k].dtype and torch.equal(loaded[k], batch[k]), k
        assert loaded.kinds[k] == batch.kinds[k]
    assert loaded.kinds["prompt_is_system"] == Kind.PROMPT
    assert dict(loaded.meta) == {"engine": "test", "n": 4, "model": "tiny@abc"}
    side = json.loads((path.parent / "roll.json").read_text())
    assert side["format_version"] == 1 and side["tensors_file"] == "roll.safetensors"
    assert side["fields"]["rollout_log_probs"]["dtype"] == "bfloat16"
    assert side["fields"]["teacher_topk_log_probs"]["shape"] == [3, 4, 2]
    assert side["fields"]["attempt"]["kind"] == "seq"
    assert side["sha256"] == canonical_sha(batch.tensors)
    assert rollout_sha256(path) == rollout_sha256(batch) == canonical_sha(batch.tensors)
    assert sorted(os.listdir(path.parent)) == ["roll.json", "roll.safetensors"]  # no temp files


def test_hash_does_not_depend_on_file_layout(saved, tmp_path):
    batch, _ = saved
    other = tmp_path / "other.safetensors"
    safetensors.torch.save_file({k: v for k, v in reversed(list(batch.tensors.items()))},
                                str(other), metadata={"anything": "else"})
    assert rollout_sha256(other) == canonical_sha(batch.tensors)
    changed = dict(batch.tensors, scores=torch.tensor([1.0, 0.0, 0.25], dtype=torch.float64))
    assert rollout_sha256(changed) != rollout_sha256(batch)


def test_a_file_saved_again_hashes_as_its_new_contents(saved):
    """File hashes are remembered per process by file stamps: saving other rows to the same
    path gives the new rows' hash, not the remembered one."""
    batch, path = saved
    assert rollout_sha256(path) == canonical_sha(batch.tensors)
    changed = batch.with_fields(scores=torch.tensor([1.0, 0.0, 0.25], dtype=torch.float64))
    save_rollout(changed, path)
    assert rollout_sha256(path) == canonical_sha(changed.tensors) != canonical_sha(batch.tensors)


def test_save_does_not_mutate_or_keep_aliases(saved):
    batch = make_batch()
    versions = {k: v._version for k, v in batch.tensors.items()}
    before = batch.clone()
    save_rollout(batch, saved[1].parent / "again.safetensors")
    for k in batch.keys():
        assert batch[k]._version == versions[k] and torch.equal(batch[k], before[k])


def expect_error(path, key, source=None):
    with pytest.raises(InputError) as err:
        load_rollout(path)
    source = str(source or path)
    assert err.value.source == source and source in str(err.value)
    assert err.value.key == key
    if key:
        assert key in str(err.value)
    return err.value


def test_truncated_file(saved):
    _, path = saved
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 7])
    err = expect_error(path, None)
    assert "safetensors" in str(err)


def test_tampered_byte_names_the_field(saved):
    _, path = saved
    data = bytearray(path.read_bytes())
    (header_len,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + header_len])
    # the field whose data holds the file's last byte, from the header's own offsets
    last = max((v["data_offsets"][1], k) for k, v in header.items() if k != "__metadata__")[1]
    data[-1] ^= 0x01
    path.write_bytes(bytes(data))
    err = expect_error(path, last)
    assert "sha256" in str(err)


def test_missing_file_and_missing_sidecar(saved, tmp_path):
    _, path = saved
    expect_error(tmp_path / "nope.safetensors", None)
    sidecar_path(path).unlink()
    err = expect_error(path, None, source=sidecar_path(path))
    assert "roll.json" in str(err)


def test_nan_in_log_probs(saved):
    batch, path = saved
    lp = batch["old_log_probs"].clone()
    lp[0, 1] = float("nan")  # under the mask: still rejected (validation demands finite values)
    rewrite(path, dict(batch.tensors, old_log_probs=lp))
    assert "non-finite" in str(expect_error(path, "old_log_probs"))


def test_missing_required_field(saved):
    batch, path = saved
    rewrite(path, {k: v for k, v in batch.tensors.items() if k != "response_mask"})
    assert "required" in str(expect_error(path, "response_mask"))


def test_unknown_field_kind(saved):
    batch, path = saved

    def edit(side):
        side["fields"]["attempt"]["kind"] = "per-row"

    rewrite(path, dict(batch.tensors), edit)
    err = expect_error(path, "attempt", source=sidecar_path(path))
    assert "per-row" in str(err)


def test_mask_true_past_response_length(saved):
    batch, path = saved
    mask = batch["response_mask"].clone()
    mask[1, 0] = True  # row 1 has response length 0
    rewrite(path, dict(batch.tensors, response_mask=mask))
    assert "row 1" in str(expect_error(path, "response_mask"))


def test_sidecar_shape_or_field_list_disagrees(saved):
    batch, path = saved

    def edit(side):
        side["fields"]["scores"]["shape"] = [4]

    rewrite(path, dict(batch.tensors), edit)
    expect_error(path, "scores")

    def drop(side):
        del side["fields"]["attempt"]

    rewrite(path, dict(batch.tensors), drop)
    expect_error(path, "attempt", source=sidecar_path(path))


def test_total_hash_mismatch(saved):
    batch, path = saved

    def edit(side):
        side["sha256"] = "0" * 64

    rewrite(path, dict(batch.tensors), edit)
    expect_error(path, "sha256", source=sidecar_path(path))


def test_invalid_batch_or_meta_is_never_written(tmp_path):
    batch = make_batch()
    bad = RolloutBatch(dict(batch.tensors, scores=torch.tensor([1.0, float("inf"), 0.0],
                                                               dtype=torch.float64)),
                       dict(batch.kinds), {})
    with pytest.raises(InputError, match="scores"):
        save_rollout(bad, tmp_path / "bad.safetensors")
    with pytest.raises(InputError) as err:
        save_rollout(batch, tmp_path / "bad.safetensors", meta={"x": object()})
    assert err.value.key == "meta"
    with pytest.raises(InputError) as err:
        save_rollout(batch, tmp_path / "bad.pt")
    assert err.value.key == "path"
    assert os.listdir(tmp_path) == []


def test_failed_write_keeps_previous_rollout(saved, monkeypatch):
    batch, path = saved
    before = (path.read_bytes(), sidecar_path(path).read_bytes())

    def boom(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(rio, "_atomic_write", lambda p, d: boom() if p.suffix == ".json"
                        else _orig_atomic_write(p, d))
    with pytest.raises(OSError):
        save_rollout(batch.select([0]), path)
    assert (path.read_bytes(), sidecar_path(path).read_bytes()) == before
    assert sorted(os.listdir(path.parent)) == ["roll.json", "roll.safetensors"]
    assert len(load_rollout(path)) == 3


_orig_atomic_write = rio._atomic_write
