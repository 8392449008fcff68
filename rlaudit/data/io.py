"""The fixed-rollout file format: tensors in safetensors plus a JSON sidecar. No pickle anywhere.

A rollout ``run1.safetensors`` comes with ``run1.json``::

    {"format": "rlaudit.rollout", "format_version": 1,
     "tensors_file": "run1.safetensors",
     "fields": {"<name>": {"kind": "token", "dtype": "float32", "shape": [8, 16],
                           "sha256": "<hex of that field's canonical record>"}, ...},
     "sha256": "<hex over all fields, see rollout_sha256>",
     "meta": {"engine": "vllm", "sampling": {...}, "model": "<snapshot id>", ...},
     "written_by": {"rlaudit": "0.1.0", "torch": "2.13.0", "safetensors": "0.8.0"}}

A rollout scored by several reward functions (TRL's ``reward_funcs`` with ``reward_weights``)
adds the fields ``reward_scores`` ``[B, F]`` and optionally ``reward_mask`` ``[B, F]`` and, in
``meta``, ``reward_functions`` (F names) and ``reward_weights`` (F numbers, default 1 each);
``scores`` is then their combination (rlaudit/data/rewards.py), computed at load when the file
leaves it out.

The hash is defined on the tensors, not on the file bytes, so it does not depend on safetensors'
header layout: for each field in sorted name order, a header line
``json.dumps([name, dtype, shape, nbytes]) + "\\n"`` (dtype without ``torch.``) followed by the
tensor's raw C-contiguous little-endian bytes. ``nbytes`` makes the stream unambiguous. The
per-field hash is the sha256 of that field's record alone, so a mismatch names the field.

Both files are written to temporary files in the target directory and moved into place with
``os.replace`` (tensors first, then the sidecar), so neither file is ever half-written. If a crash
falls between the two renames, the pair disagrees and :func:`load_rollout` refuses it (hash).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import uuid
from pathlib import Path
from typing import Mapping

import safetensors
import safetensors.torch
import torch

import rlaudit
from rlaudit.data.batch import Kind, RolloutBatch
from rlaudit.data.rewards import with_combined_scores
from rlaudit.errors import InputError
from rlaudit.stamps import file_stamps

FORMAT_NAME = "rlaudit.rollout"
FORMAT_VERSION = 1
SUFFIX = ".safetensors"


def sidecar_path(path: str | os.PathLike) -> Path:
    """``run1.safetensors`` -> ``run1.json`` (same directory)."""
    return Path(path).with_suffix(".json")


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _field_record(name: str, t: torch.Tensor) -> tuple[bytes, memoryview]:
    """(header line, raw bytes) of one field in the canonical hash stream (the bytes are a view of
    the tensor's CPU copy, not a copy of their own)."""
    if t.is_quantized:  # its bytes leave out the scale and zero point
        raise ValueError(f"{name}: a quantized tensor has no canonical hash")
    t = t.detach().to("cpu").contiguous()
    raw = memoryview(t.reshape(-1).view(torch.uint8).numpy() if t.numel() else b"")
    header = json.dumps([name, _dtype_name(t.dtype), list(t.shape), raw.nbytes]) + "\n"
    return header.encode("utf-8"), raw


def _hashes(tensors: Mapping[str, torch.Tensor], *, per_field: bool = True
            ) -> tuple[str, dict[str, str]]:
    """(sha256 over all fields, {name: sha256 of that field's record}; empty unless
    ``per_field``)."""
    if sys.byteorder != "little":  # the raw bytes are defined as little-endian
        raise RuntimeError("rollout hashing needs a little-endian machine")
    total = hashlib.sha256()
    fields = {}
    for name in sorted(tensors):
        header, raw = _field_record(name, tensors[name])
        total.update(header)
        total.update(raw)
        if per_field:
            one = hashlib.sha256(header)
            one.update(raw)
            fields[name] = one.hexdigest()
    return total.hexdigest(), fields


def rollout_sha256(rollout: str | os.PathLike | RolloutBatch | Mapping[str, torch.Tensor]) -> str:
    """Canonical sha256 of a rollout's tensors (see the module docstring).

    ``rollout`` is a ``.safetensors`` path (the tensors are read and hashed; the sidecar is not
    trusted), a :class:`RolloutBatch`, or a mapping of field name -> tensor. A saved batch and the
    file it was saved to hash the same.
    """
    if isinstance(rollout, RolloutBatch):
        return _hashes(rollout.tensors, per_field=False)[0]
    if isinstance(rollout, Mapping):
        return _hashes(rollout, per_field=False)[0]
    path = _existing(Path(rollout))
    stamp = file_stamps([path])
    known = _FILE_SHAS.get(stamp)
    if known is None:
        known = _FILE_SHAS[stamp] = _hashes(_read_tensors(path), per_field=False)[0]
    return known


#: rollout files hashed in this process, by :func:`rlaudit.stamps.file_stamps` (a scenario's
#: rollout is hashed for its provenance and its golden; the file is read each time otherwise)
_FILE_SHAS: dict[tuple, str] = {}


def _atomic_write(path: Path, data: bytes) -> Path:
    """Write ``data`` to a new temp file next to ``path`` (fsynced; created with the usual umask
    permissions, unlike ``mkstemp``'s 0600); return the temp path."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex}.tmp")
    try:
        with open(tmp, "xb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return tmp


def save_rollout(batch: RolloutBatch, path: str | os.PathLike, *,
                 meta: Mapping[str, object] | None = None) -> None:
    """Write ``batch`` to ``path`` (``*.safetensors``) and its JSON sidecar, atomically.

    The batch is validated first (an invalid or 0-row batch is never written). The sidecar's ``meta`` is
    ``batch.meta`` updated with ``meta`` (``meta`` wins on shared keys); it must be JSON-able.
    Tensors are stored as they are (any dtype, moved to CPU); the batch is not changed.
    """
    path = Path(path)
    if path.suffix != SUFFIX:
        raise InputError(f"expected a path ending in {SUFFIX}", source=str(path), key="path")
    if not path.parent.is_dir():
        raise InputError("directory does not exist", source=str(path.parent), key="path")
    batch.validate(source=str(path))
    require_rows(batch, source=str(path))
    merged = {**batch.meta, **(meta or {})}
    tensors = {k: v.detach().to("cpu").contiguous().clone() for k, v in batch.tensors.items()}
    total, per_field = _hashes(tensors)
    sidecar = {
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        "tensors_file": path.name,
        "fields": {name: {"kind": Kind(batch.kinds[name]).value,
                          "dtype": _dtype_name(t.dtype), "shape": list(t.shape),
                          "sha256": per_field[name]}
                   for name, t in sorted(tensors.items())},
        "sha256": total,
        "meta": merged,
        "written_by": {"rlaudit": rlaudit.__version__, "torch": torch.__version__,
                       "safetensors": safetensors.__version__},
    }
    try:
        sidecar_text = json.dumps(sidecar, indent=1, sort_keys=True, allow_nan=False) + "\n"
    except (TypeError, ValueError) as e:
        raise InputError(f"meta must be JSON-serialisable (finite numbers, str keys): {e}",
                         source=str(path), key="meta") from None
    tmp_tensors = _atomic_write(path, safetensors.torch.save(tensors))
    try:
        tmp_sidecar = _atomic_write(sidecar_path(path), sidecar_text.encode("utf-8"))
    except BaseException:
        tmp_tensors.unlink(missing_ok=True)
        raise
    os.replace(tmp_tensors, path)
    os.replace(tmp_sidecar, sidecar_path(path))


def _existing(path: Path) -> Path:
    if not path.is_file():
        raise InputError("rollout file not found", source=str(path))
    return path


def _read_tensors(path: Path) -> dict[str, torch.Tensor]:
    _existing(path)
    try:
        return safetensors.torch.load(path.read_bytes())
    except (safetensors.SafetensorError, ValueError, OSError) as e:
        raise InputError(f"not a readable safetensors file (truncated or corrupt?): {e}",
                         source=str(path)) from None


def _read_sidecar(path: Path) -> dict:
    side = sidecar_path(path)
    if not side.is_file():
        raise InputError(f"missing sidecar {side.name} next to the rollout (written by "
                         f"save_rollout)", source=str(side))
    try:
        doc = json.loads(side.read_text(encoding="utf-8"))
    except (ValueError, OSError) as e:
        raise InputError(f"sidecar is not valid JSON: {e}", source=str(side)) from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT_NAME:
        raise InputError(f"not an rlaudit rollout sidecar (expected format {FORMAT_NAME!r})",
                         source=str(side), key="format")
    if doc.get("format_version") != FORMAT_VERSION:
        raise InputError(f"unsupported format_version {doc.get('format_version')!r}; this "
                         f"rlaudit reads {FORMAT_VERSION}", source=str(side), key="format_version")
    for key, typ in (("fields", dict), ("sha256", str), ("meta", dict)):
        if not isinstance(doc.get(key), typ):
            raise InputError(f"expected a {typ.__name__}", source=str(side), key=key)
    for name, spec in doc["fields"].items():
        if not isinstance(spec, dict) or not {"kind", "dtype", "shape", "sha256"} <= set(spec):
            raise InputError("expected an object with kind, dtype, shape and sha256",
                             source=str(side), key=f"fields.{name}")
    return doc


def load_rollout(path: str | os.PathLike) -> RolloutBatch:
    """Read and verify a rollout written by :func:`save_rollout`.

    Checks, in order: both files exist and parse; the fields, dtypes and shapes in the file match
    the sidecar; each field's sha256 and the total sha256; each kind is seq/prompt/token; then
    several reward functions (``reward_scores``, ``meta.reward_functions``, ``reward_weights``:
    rlaudit/data/rewards.py) consistent, ``scores`` computed from them when the file leaves it
    out; :meth:`RolloutBatch.from_tensors` (required fields, shapes, dtypes, masks, finite
    values); at least one row.
    Every failure is an :class:`InputError` naming the file (``source``) and field (``key``).
    """
    path = Path(path)
    tensors = _read_tensors(path)
    doc = _read_sidecar(path)
    side, src = str(sidecar_path(path)), str(path)
    fields = doc["fields"]
    for name in sorted(set(fields) | set(tensors)):
        if name not in tensors:
            raise InputError("field listed in the sidecar is missing from the tensors file",
                             source=src, key=name)
        if name not in fields:
            raise InputError("field in the tensors file is not listed in the sidecar",
                             source=side, key=name)
        t, spec = tensors[name], fields[name]
        if _dtype_name(t.dtype) != spec["dtype"] or list(t.shape) != spec["shape"]:
            raise InputError(f"tensor is {_dtype_name(t.dtype)} {list(t.shape)}, the sidecar says "
                             f"{spec['dtype']} {spec['shape']}", source=src, key=name)
    total, per_field = _hashes(tensors)
    for name in sorted(fields):
        if per_field[name] != fields[name]["sha256"]:
            raise InputError(f"sha256 mismatch: the tensor data was modified or the sidecar is "
                             f"stale (sidecar {fields[name]['sha256'][:12]}..., data "
                             f"{per_field[name][:12]}...)", source=src, key=name)
    if total != doc["sha256"]:
        raise InputError(f"total sha256 mismatch (sidecar {doc['sha256'][:12]}..., data "
                         f"{total[:12]}...)", source=side, key="sha256")
    kinds = {}
    for name in sorted(fields):
        try:
            kinds[name] = Kind(fields[name]["kind"])
        except ValueError:
            raise InputError(f"unknown field kind {fields[name]['kind']!r}; expected one of "
                             f"{', '.join(k.value for k in Kind)}", source=side,
                             key=name) from None
    # several reward functions: ``scores`` is their combination (rlaudit/data/rewards.py)
    tensors = with_combined_scores(tensors, doc["meta"], source=src)
    batch = RolloutBatch.from_tensors(tensors, kinds=kinds, meta=doc["meta"], source=src)
    require_rows(batch, source=src)
    return batch


def require_rows(batch: RolloutBatch, *, source: str | None) -> None:
    """A fixed rollout has at least one row: a 0-row file replays nothing, so every check on it
    would pass vacuously (InputError naming ``response_ids``)."""
    if len(batch) == 0:
        raise InputError(f"the rollout has 0 rows (response_ids has shape "
                         f"{list(batch['response_ids'].shape)}): nothing to replay",
                         source=source, key="response_ids")
