"""Scenario files: what to replay, on which backends, checked by which invariants.

A scenario is a YAML file under ``scenarios/``::

    description: entropy is logged when entropy_coeff is 0 but calculate_entropy is on (verl #6016)
    model: models/qwen2-tiny                 # HF snapshot, relative to this file
    ref_model: models/qwen2-tiny-ref         # optional reference policy (default: the model)
    rollout: rollouts/qwen2-digits.safetensors
    steps: 2                                 # training steps replayed on the fixed rollout
    dtype: float64                           # float32 | float64 | bfloat16
    config:                                  # the rlaudit.config tree (verl key names)
      actor: {entropy_coeff: 0.0, calculate_entropy: true, optim: {name: sgd, lr: 0.1}}
    backends:                                # name -> layout
      reference: {}
      fsdp: {dp: 2}
      megatron: {tp: 2, pp: 1, dp: 1}
    invariants: [entropy-logged-when-coeff-zero, backend-parity, microbatch-invariance]
    tolerances:                              # optional; per metric/tensor name, or "default"
      default: {rtol: 1.0e-6, atol: 1.0e-9}
      actor/grad_norm: {rtol: 1.0e-5}
    tags: [seed]

Everything is validated on load: unknown keys, bad values, unknown backends/invariants, missing
files are :class:`InputError` naming the file and the dotted key.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from rlaudit import catalogue  # the invariant names without importing the invariants (torch)
from rlaudit.config import Config, load_config
from rlaudit.errors import InputError
from rlaudit.scenarios.bounds import check_sizes, check_unique_names
from rlaudit.verdict.tolerance import DEFAULT_TOLERANCES, Tolerance
from rlaudit.yaml_load import load_yaml

TOP_KEYS = {"name", "description", "model", "ref_model", "rollout", "steps", "dtype", "config", "backends",
            "invariants", "tolerances", "tags", "device"}
BACKEND_LAYOUT_KEYS = {"reference": set(), "fsdp": {"dp"}, "megatron": {"tp", "pp", "dp"}}
DTYPES = ("float32", "float64", "bfloat16")


@dataclass
class Scenario:
    name: str
    path: Path
    description: str
    model: Path
    rollout: Path
    config: Config
    backends: dict[str, dict[str, int]]
    invariants: list[str]
    steps: int = 1
    dtype: str = "float64"
    device: str = "cpu"
    tolerances: dict[str, Tolerance] = field(default_factory=dict)
    tags: list[str] = field(default_factory=list)
    ref_model: Path | None = None
    """Reference policy snapshot (default: the initial actor, so KL starts at 0)."""
    tol_floor: Tolerance | None = None
    """Set when the scenario runs against a target (``rlaudit run --target``): the tolerance its
    declared train precision allows (rlaudit.targets.contract.declare); every tolerance is at least this."""
    tol_overrides: dict[str, Tolerance] = field(default_factory=dict)
    """A target's explicit run-level tolerance overrides, by metric/tensor name (win over all)."""

    def tol(self, name: str) -> Tolerance:
        """Tolerance for a metric or tensor name: a target's override, else the exact entry, else
        "default", else by dtype; then at least :attr:`tol_floor`."""
        if name in self.tol_overrides:
            return self.tol_overrides[name]
        if name in self.tolerances:
            t = self.tolerances[name]
        elif "default" in self.tolerances:
            t = self.tolerances["default"]
        else:
            d = DEFAULT_TOLERANCES[self.dtype]
            t = Tolerance(d["rtol"], d["atol"])
        if self.tol_floor is not None:
            t = Tolerance(max(t.rtol, self.tol_floor.rtol), max(t.atol, self.tol_floor.atol))
        return t


def _expect(cond: bool, msg: str, source: str, key: str) -> None:
    if not cond:
        raise InputError(msg, source=source, key=key)


def load_scenario(path: str | Path) -> Scenario:
    path = Path(path)
    src = str(path)
    if not path.exists():
        raise InputError("scenario file does not exist", source=src)
    try:
        data = load_yaml(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as e:
        raise InputError(f"not valid YAML: {e}", source=src) from None
    except UnicodeDecodeError as e:
        raise InputError(f"not a UTF-8 text file: {e}", source=src) from None
    return scenario_from_dict(data, path=path)


def scenario_from_dict(data: Any, *, path: Path) -> Scenario:
    src = str(path)
    _expect(isinstance(data, dict), "expected a mapping at the top level", src, "")
    _expect(data.get("kind") != "stage-case", "a stage case found by `rlaudit fuzz` replays "
            "against the adapter it was found on: rlaudit run --target MODULE:ADAPTER "
            f"{path}", src, "kind")
    unknown = sorted(set(data) - TOP_KEYS)
    _expect(not unknown, f"unknown key; valid keys: {', '.join(sorted(TOP_KEYS))}", src,
            unknown[0] if unknown else "")
    for key in ("model", "rollout", "invariants"):
        _expect(key in data, "required key is missing", src, key)
    base = path.parent
    model = _resolve(base, data["model"], src, "model")
    _expect((model / "config.json").exists(), f"{model} is not a model snapshot (no config.json)",
            src, "model")
    ref_model = None
    if data.get("ref_model") is not None:
        ref_model = _resolve(base, data["ref_model"], src, "ref_model")
        _expect((ref_model / "config.json").exists(),
                f"{ref_model} is not a model snapshot (no config.json)", src, "ref_model")
    rollout = _resolve(base, data["rollout"], src, "rollout")
    _expect(rollout.exists(), f"rollout file {rollout} does not exist", src, "rollout")

    steps = data.get("steps", 1)
    _expect(isinstance(steps, int) and not isinstance(steps, bool) and steps >= 1,
            f"expected an integer >= 1, got {steps!r}", src, "steps")
    dtype = data.get("dtype", "float64")
    _expect(dtype in DTYPES, f"expected one of {list(DTYPES)}, got {dtype!r}", src, "dtype")
    device = data.get("device", "cpu")
    _expect(device in ("cpu", "cuda"), f"expected cpu or cuda, got {device!r}", src, "device")

    _expect(isinstance(data.get("config") or {}, dict), "expected a mapping", src, "config")
    cfg_data = dict(data.get("config") or {})
    cfg_data.setdefault("trainer", {})
    _expect(isinstance(cfg_data["trainer"], dict), "expected a mapping", src, "config.trainer")
    cfg_data["trainer"] = {**cfg_data["trainer"], "dtype": dtype}
    config = load_config(cfg_data, source=src, prefix="config.")

    backends = _backends(data.get("backends", {"reference": {}}), src)
    invariants = _invariants(data["invariants"], src)
    tolerances = _tolerances(data.get("tolerances", {}), src)
    tags = data.get("tags", [])
    _expect(isinstance(tags, list) and all(isinstance(t, str) for t in tags),
            "expected a list of strings", src, "tags")
    desc = data.get("description", "")
    _expect(isinstance(desc, str), "expected a string", src, "description")
    name = data.get("name", path.stem)
    _expect(isinstance(name, str) and name, "expected a non-empty string", src, "name")
    # the name becomes golden/<name>.json: it must not point anywhere else
    _expect(not set(name) & {"/", "\\"} and name not in (".", ".."),
            f"expected a file-name-safe string (no path separators), got {name!r}", src, "name")
    scn = Scenario(name=name, path=path, description=desc.strip(), model=model,
                   ref_model=ref_model, rollout=rollout,
                   config=config, backends=backends, invariants=invariants, steps=steps,
                   dtype=dtype, device=device, tolerances=tolerances, tags=tags)
    check_sizes(scn)  # before anything iterates over steps, epochs or ranks
    return scn


def _resolve(base: Path, value: Any, src: str, key: str) -> Path:
    _expect(isinstance(value, str) and value, "expected a path string", src, key)
    p = Path(value)
    return p if p.is_absolute() else (base / p).resolve()


def _backends(value: Any, src: str) -> dict[str, dict[str, int]]:
    _expect(isinstance(value, dict) and value, "expected a non-empty mapping backend -> layout",
            src, "backends")
    out = {}
    for name, layout in value.items():
        key = f"backends.{name}"
        _expect(name in BACKEND_LAYOUT_KEYS,
                f"unknown backend; valid: {', '.join(sorted(BACKEND_LAYOUT_KEYS))}", src, key)
        layout = layout or {}
        _expect(isinstance(layout, dict), "expected a mapping of layout sizes", src, key)
        for k, v in layout.items():
            _expect(k in BACKEND_LAYOUT_KEYS[name],
                    f"unknown layout key; valid for {name}: "
                    f"{', '.join(sorted(BACKEND_LAYOUT_KEYS[name])) or 'none'}", src, f"{key}.{k}")
            _expect(isinstance(v, int) and not isinstance(v, bool) and v >= 1,
                    f"expected an integer >= 1, got {v!r}", src, f"{key}.{k}")
        out[name] = {k: int(v) for k, v in layout.items()}
    return out


def _invariants(value: Any, src: str) -> list[str]:
    _expect(isinstance(value, list) and value and all(isinstance(v, str) for v in value),
            "expected a non-empty list of invariant names", src, "invariants")
    known = catalogue.invariants()
    for i, name in enumerate(value):
        known.get(name, source=src, key=f"invariants[{i}]")
    return list(dict.fromkeys(value))


def _tolerances(value: Any, src: str) -> dict[str, Tolerance]:
    _expect(isinstance(value, dict), "expected a mapping name -> {rtol, atol}", src, "tolerances")
    out = {}
    for name, tol in value.items():
        key = f"tolerances.{name}"
        _expect(isinstance(tol, dict) and set(tol) <= {"rtol", "atol"} and tol,
                "expected a mapping with rtol and/or atol", src, key)
        vals = {}
        for k in ("rtol", "atol"):
            v = tol.get(k, 0.0)
            if isinstance(v, str):
                try:
                    v = float(v)
                except ValueError:
                    pass
            _expect(isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0,
                    f"expected a number >= 0, got {v!r}", src, f"{key}.{k}")
            # inf (or NaN) as a bound makes every comparison with it pass (or none)
            _expect(math.isfinite(v), f"expected a finite number, got {v!r}: an infinite "
                    "tolerance makes every comparison pass", src, f"{key}.{k}")
            vals[k] = float(v)
        out[name] = Tolerance(**vals)
    return out


#: directories under the scenarios root that hold data, not scenarios to discover (found/:
#: cases written by `rlaudit fuzz`, replayed by path against their target)
NOT_SCENARIO_DIRS = {"models", "rollouts", "found"}


def discover(root: str | Path) -> list[Path]:
    """Scenario files under ``root`` (``*.yaml`` not inside models/, rollouts/ or found/),
    sorted."""
    root = Path(root)
    return sorted(p for p in root.rglob("*.yaml")
                  if not NOT_SCENARIO_DIRS & set(p.relative_to(root).parts[:-1]))


def resolve(names: list[str], *, all_: bool, root: str | Path) -> list[Path]:
    """Scenario names (file stems) or paths, or with ``all_`` every scenario under ``root``."""
    root = Path(root)
    discovered = discover(root) if root.is_dir() else []
    check_unique_names(discovered)
    found = {p.stem: p for p in discovered}
    if all_:
        if names:
            raise InputError("give scenario names or --all, not both")
        if not found:
            raise InputError(f"no scenario files under {root}", source=str(root))
        return list(found.values())
    if not names:
        raise InputError("name at least one scenario (see `rlaudit list`) or pass --all")
    out = []
    for n in names:
        p = Path(n)
        if p.suffix in (".yaml", ".yml") and p.is_file():
            out.append(p)
        elif n in found:
            out.append(found[n])
        else:
            raise InputError(f"no scenario named {n!r} under {root} (known: "
                             f"{', '.join(sorted(found)) or 'none'})", key=n)
    return out
