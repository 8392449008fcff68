"""Checkpoints of the reference trainer: weights and optimizer state in safetensors, the rest in
JSON (no pickle). A checkpoint directory ``step_<N>/`` holds, per role (actor, critic),
``<role>.model.safetensors`` and ``<role>.optim.safetensors`` + ``<role>.optim.json``, and
``trainer_state.json`` (step, metrics history, config). It is written to a temporary directory and
renamed into place, so a crash never leaves a half checkpoint; ``latest`` names the newest one.

Resuming restores weights, optimizer state and step; prompts and sampling seeds are functions of
(seed, step), so a resumed run reproduces the uninterrupted one exactly.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from rlaudit.errors import InputError


def _optim_to_flat(opt: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], dict]:
    sd = opt.state_dict()
    tensors, scalars = {}, {}
    for pid, state in sd["state"].items():
        for k, v in state.items():
            if isinstance(v, torch.Tensor):
                tensors[f"{pid}.{k}"] = v.detach().cpu().contiguous()
            else:
                scalars[f"{pid}.{k}"] = v
    return tensors, {"param_groups": sd["param_groups"], "scalars": scalars}


def _optim_from_flat(opt: torch.optim.Optimizer, tensors: dict, meta: dict) -> None:
    state: dict[int, dict] = {}
    for key, v in tensors.items():
        pid, name = key.split(".", 1)
        state.setdefault(int(pid), {})[name] = v
    for key, v in meta["scalars"].items():
        pid, name = key.split(".", 1)
        state.setdefault(int(pid), {})[name] = v
    opt.load_state_dict({"state": state, "param_groups": meta["param_groups"]})


def save_checkpoint(root: str | Path, step: int, roles: dict, state: dict) -> Path:
    """``roles``: name -> (module, optimizer or None). ``state``: JSON-able trainer state."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step}"
    tmp = Path(tempfile.mkdtemp(prefix=f".step_{step}.", dir=root))
    try:
        for name, (module, opt) in roles.items():
            sd = {k: v.detach().cpu().contiguous() for k, v in module.state_dict().items()}
            save_file(sd, str(tmp / f"{name}.model.safetensors"))
            if opt is not None:
                tensors, meta = _optim_to_flat(opt)
                save_file(tensors, str(tmp / f"{name}.optim.safetensors"))
                (tmp / f"{name}.optim.json").write_text(json.dumps(meta))
        (tmp / "trainer_state.json").write_text(json.dumps({"step": step, **state}, indent=1))
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    latest_tmp = root / ".latest.tmp"
    latest_tmp.write_text(final.name)
    os.replace(latest_tmp, root / "latest")
    return final


def latest_checkpoint(root: str | Path) -> Path | None:
    root = Path(root)
    marker = root / "latest"
    if not marker.exists():
        return None
    path = root / marker.read_text().strip()
    return path if path.exists() else None


def load_checkpoint(path: str | Path, roles: dict) -> dict:
    """Restore ``roles`` (name -> (module, optimizer or None)) in place; return the trainer state."""
    path = Path(path)
    state_file = path / "trainer_state.json"
    if not state_file.exists():
        raise InputError("not a checkpoint directory (no trainer_state.json)", source=str(path))
    for name, (module, opt) in roles.items():
        weights = path / f"{name}.model.safetensors"
        if not weights.exists():
            raise InputError(f"checkpoint has no weights for role {name!r}", source=str(weights))
        module.load_state_dict(load_file(str(weights)))
        if opt is not None:
            _optim_from_flat(opt, load_file(str(path / f"{name}.optim.safetensors")),
                             json.loads((path / f"{name}.optim.json").read_text()))
    return json.loads(state_file.read_text())
