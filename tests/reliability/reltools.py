"""Helpers of the reliability suite (tests/reliability): paths, scenario and rollout writers."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import safetensors.torch
import torch
import yaml

from rlaudit.data.batch import KNOWN_FIELDS
from rlaudit.data.io import FORMAT_NAME, FORMAT_VERSION, _hashes, load_rollout

REPO = Path(__file__).resolve().parents[2]
GOLDEN = REPO / "golden"
MODEL = REPO / "scenarios" / "models" / "qwen2-tiny-short"
ROLLOUT = REPO / "scenarios" / "rollouts" / "short-ref.safetensors"


def tree_digest(root: Path) -> dict[str, str]:
    """relative path -> sha256 of every file under ``root`` (empty when it does not exist)."""
    if not root.exists():
        return {}
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def scenario_dict(**over) -> dict:
    """The cheapest scenario: tiny model, committed rollout, one step, reference only."""
    d = {"description": "reliability suite", "model": str(MODEL), "rollout": str(ROLLOUT),
         "steps": 1, "dtype": "float64",
         "config": {"rollout": {"n": 4, "response_length": 12},
                    "actor": {"ppo_mini_batch_size": 2, "ppo_micro_batch_size_per_gpu": 2,
                              "optim": {"name": "sgd", "lr": 0.05}}},
         "backends": {"reference": {}},
         "invariants": ["sanity-bounds"]}
    d.update(over)
    return d


def scenario_with_config(key: str, value) -> dict:
    """The valid scenario with ``config.<key>`` (dotted) set to ``value``."""
    d = scenario_dict()
    node = d["config"]
    *parents, leaf = key.split(".")
    for p in parents:
        node = node.setdefault(p, {})
    node[leaf] = value
    return d


def write_scenario(path: Path, data: dict | None = None, **over) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(data if data is not None else scenario_dict(**over)))
    return path


def base_tensors() -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in load_rollout(ROLLOUT).tensors.items()}


def write_rollout(path: Path, tensors: dict[str, torch.Tensor], *, meta: dict | None = None,
                  sidecar: dict | None = None) -> Path:
    """A rollout file pair *without* rlaudit's validation (so that bad data reaches the loader
    with matching hashes): safetensors plus a sidecar in the documented format."""
    path.parent.mkdir(parents=True, exist_ok=True)
    src_side = json.loads(ROLLOUT.with_suffix(".json").read_text())
    kinds = {k: v["kind"] for k, v in src_side["fields"].items()}
    total, per_field = _hashes(tensors)
    doc = {"format": FORMAT_NAME, "format_version": FORMAT_VERSION, "tensors_file": path.name,
           "fields": {k: {"kind": kinds.get(k) or _known_kind(k), "dtype": str(t.dtype).removeprefix("torch."),
                          "shape": list(t.shape), "sha256": per_field[k]}
                      for k, t in sorted(tensors.items())},
           "sha256": total, "meta": src_side["meta"] if meta is None else meta,
           "written_by": src_side["written_by"]}
    if sidecar is not None:
        doc = sidecar
    path.write_bytes(safetensors.torch.save({k: t.contiguous() for k, t in tensors.items()}))
    path.with_suffix(".json").write_text(json.dumps(doc))
    return path


def _known_kind(name: str) -> str:
    spec = KNOWN_FIELDS.get(name)
    return spec.kind.value if spec is not None else "seq"


def run_args(scn: Path, tmp: Path, *extra) -> list:
    """``run SCENARIO`` with its own golden and report dirs under ``tmp``, no MLflow."""
    return ["run", scn, "--golden-dir", tmp / "golden", "--report-dir", tmp / "reports",
            "--no-mlflow", *extra]


def assert_named(err: str, source, key: str) -> None:
    """The message names the file and the key (``file: key: ...``)."""
    assert f"{source}: {key}:" in err, err
    assert "Traceback" not in err, err
