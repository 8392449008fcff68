"""Stage cases found by ``rlaudit fuzz``: writing them, reading them, replaying them.

A found stage case is two files under ``scenarios/found/``:

- ``<name>.yaml``: ``kind: stage-case``, the ``check`` that failed, the ``overrides`` it ran
  under (the estimator, KL kind, loss mode, aggregation, clip setting or layout: the keys of
  :attr:`rlaudit.targets.stages.registry.StageEnv.overrides`), the failure ``message``, provenance;
- ``<name>.safetensors`` (+ its JSON sidecar): the input, as an rlaudit rollout file
  (:func:`rlaudit.data.io.save_rollout`, sha256-checked on load). A math-stage case is stored as a
  batch whose extra fields are the case's tensors (``log_probs``, ``advantages``, ...); a
  micro-batching input is the batch itself; a filter input carries its metric as the field
  ``filter_metric``.

``rlaudit run --target X scenarios/found/<name>.yaml`` replays it: the checks of that stage run
on exactly that input and configuration, through the same code the fuzzer probed with
(:func:`stage_results`), with the adapter's declarations; exit 1 while the bug is there.
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

import torch
import yaml

from rlaudit.data.batch import Kind, RolloutBatch
from rlaudit.data.io import load_rollout, save_rollout
from rlaudit.errors import InputError
from rlaudit.targets.contract.adapter import adapter_name
from rlaudit.targets.inputs.cases import FLOAT_FIELDS, Case, Draw
from rlaudit.targets.stages.filter import FilterInput
from rlaudit.targets.stages.registry import StageEnv
from rlaudit.targets.stages.suite import stage_checks
from rlaudit.verdict.result import CheckResult, ScenarioResult
from rlaudit.yaml_load import load_yaml

KIND = "stage-case"
KEYS = {"kind", "description", "target", "check", "inputs", "input_kind", "overrides",
        "message", "found_by"}
#: overrides stored as lists in YAML and read back as tuples
_TUPLES = ("clip_settings", "layouts", "loss_modes", "loss_agg_modes", "advantage_estimators",
           "kl_estimators", "distill_losses")


def stage_results(env: StageEnv, stage: str) -> list[CheckResult]:
    """Every check of ``stage`` on ``env`` (no-mutation last: it reads what the others called)."""
    checks = sorted((c for c in stage_checks().values() if c.stage == stage),
                    key=lambda c: c.name.endswith("no-mutation"))
    return [c.fn(env) for c in checks]


def is_stage_case(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a YAML file with ``kind: stage-case``."""
    p = Path(path)
    if p.suffix not in (".yaml", ".yml") or not p.is_file():
        return False
    try:
        data = load_yaml(p.read_text(encoding="utf-8"))
    except (yaml.YAMLError, UnicodeDecodeError, OSError):
        return False
    return isinstance(data, dict) and data.get("kind") == KIND


# ---- writing -----------------------------------------------------------------------------------

def _case_batch(case: Case) -> RolloutBatch:
    b, r = case.shape
    tensors = {k: v for k, v in case.tensors.items()}
    tensors.update(prompt_ids=torch.arange(b).unsqueeze(1) + 1000,
                   prompt_lengths=torch.ones(b, dtype=torch.int64),
                   response_ids=torch.zeros(b, r, dtype=torch.int64))
    return RolloutBatch.from_tensors(tensors, kinds={"log_probs": Kind.TOKEN})


def _input_batch(draw: Draw) -> tuple[str, RolloutBatch]:
    if draw.cases:      # the cases' rows one after the other; meta says where each one is
        batch = RolloutBatch.concat([_case_batch(c) for c in draw.cases])
        meta = {"cases": [{"name": c.name, "rows": c.shape[0], "width": c.shape[1]}
                          for c in draw.cases]}
        return "case", RolloutBatch(dict(batch.tensors), dict(batch.kinds), meta)
    if draw.overrides.get("microbatch_inputs"):
        return "microbatch", draw.overrides["microbatch_inputs"][0]
    f: FilterInput = draw.overrides["filter_inputs"][0]
    return "filter", f.batch.with_fields(kinds={"filter_metric": Kind.SEQ},
                                         filter_metric=f.metric)


def _yaml_overrides(overrides: dict) -> dict:
    out = {}
    for k, v in overrides.items():
        if k in ("microbatch_inputs", "filter_inputs"):
            continue
        if k in _TUPLES:
            v = [list(x) if isinstance(x, tuple) else x for x in v]
        out[k] = v
    return out


def save_stage_case(directory: str | os.PathLike, name: str, *, target: str, check: str,
                    draw: Draw, message: str, found_by: dict) -> Path:
    """Write ``<directory>/<name>.yaml`` and its input file; returns the YAML's path."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    input_kind, batch = _input_batch(draw)
    save_rollout(batch, directory / f"{name}.safetensors")
    doc = {
        "kind": KIND,
        "description": (f"A minimal input on which {target} fails {check}, found by `rlaudit "
                        f"fuzz`. Replay: rlaudit run --target {target} "
                        f"{directory / (name + '.yaml')}"),
        "target": target, "check": check, "inputs": f"{name}.safetensors",
        "input_kind": input_kind, "overrides": _yaml_overrides(draw.overrides),
        "message": message, "found_by": found_by,
    }
    return write_yaml(directory / f"{name}.yaml", doc)


def write_yaml(path: Path, doc: dict, *, header: str = "") -> Path:
    """Write ``doc`` (after the comment lines ``header``) to ``path`` atomically: a temporary
    file in the same folder, renamed into place, so a reader never sees half a finding."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(header)
            yaml.safe_dump(doc, f, sort_keys=False, width=100)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


# ---- reading and replaying ---------------------------------------------------------------------

def load_stage_case(path: str | os.PathLike) -> tuple[str, Draw, dict]:
    """``(check, draw, document)`` of a found stage case; InputError naming file and key."""
    path = Path(path)
    src = str(path)
    try:
        doc = load_yaml(path.read_text(encoding="utf-8"))
    except (yaml.YAMLError, UnicodeDecodeError, OSError) as e:
        raise InputError(f"not a readable YAML file: {e}", source=src) from None
    if not isinstance(doc, dict) or doc.get("kind") != KIND:
        raise InputError(f"expected kind: {KIND}", source=src, key="kind")
    unknown = sorted(set(doc) - KEYS)
    if unknown:
        raise InputError(f"unknown key; valid keys: {', '.join(sorted(KEYS))}", source=src,
                         key=unknown[0])
    check = doc.get("check")
    if check not in stage_checks():
        raise InputError(f"unknown stage check {check!r}", source=src, key="check")
    if not isinstance(doc.get("inputs"), str):
        raise InputError("expected the input file's name", source=src, key="inputs")
    overrides = doc.get("overrides") or {}
    if not isinstance(overrides, dict):
        raise InputError("expected a mapping", source=src, key="overrides")
    overrides = {k: tuple(tuple(x) if isinstance(x, list) else x for x in v)
                 if k in _TUPLES else v for k, v in overrides.items()}
    batch = load_rollout(path.parent / doc["inputs"])
    kind = doc.get("input_kind")
    if kind == "case":
        fields = (*FLOAT_FIELDS, "response_mask", "uid", "response_lengths")
        missing = [f for f in fields if f not in batch]
        if missing:
            raise InputError(f"a case input needs the fields {missing}", source=doc["inputs"])
        cases, start = [], 0
        for c in batch.meta.get("cases") or [{"name": "found", "rows": len(batch),
                                               "width": batch.response_width}]:
            rows, width = int(c["rows"]), int(c["width"])
            cases.append(Case(str(c["name"]), {
                f: (batch[f][start:start + rows, :width] if batch.kinds[f] == Kind.TOKEN
                    else batch[f][start:start + rows]).clone() for f in fields}))
            start += rows
        draw = Draw(tuple(cases), overrides)
    elif kind == "microbatch":
        draw = Draw((), {**overrides, "microbatch_inputs": (batch,)})
    elif kind == "filter":
        metric = batch["filter_metric"]
        draw = Draw((), {**overrides, "filter_inputs": (
            FilterInput(path.stem, batch.without("filter_metric"), metric),)})
    else:
        raise InputError(f"expected case, microbatch or filter, got {kind!r}", source=src,
                         key="input_kind")
    return check, draw, doc


def probe_env(adapter: object, draw: Draw, decl=None) -> StageEnv:
    """The StageEnv a draw runs in (the fuzzer's and the replay's: one code path)."""
    # the draw's cases given, the fixed ones are not built (and thrown away)
    given = {"cases": list(draw.cases)} if draw.cases else {}
    return StageEnv(adapter, overrides=dict(draw.overrides), decl=decl, **given)


def replay(adapter: object, path: str | os.PathLike) -> ScenarioResult:
    """Every check of the found case's stage on its input: the pseudo-scenario
    ``found:<name>``."""
    t0 = time.perf_counter()
    check, draw, doc = load_stage_case(path)
    stage = stage_checks()[check].stage
    name = adapter_name(adapter)
    res = ScenarioResult(scenario=f"found:{Path(path).stem}", path=str(path), backends=[name],
                         tags=["stages", "found"])
    if not callable(getattr(adapter, stage, None)):
        raise InputError(f"{name} does not provide {stage}, the stage of this case",
                         source=str(path), key="check")
    res.checks = stage_results(probe_env(adapter, draw), stage)
    res.seconds = time.perf_counter() - t0
    return res
