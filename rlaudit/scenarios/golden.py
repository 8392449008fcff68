"""Golden metrics: one human-diffable JSON file per scenario under ``golden/``.

    {
      "scenario": "seed_entropy_coeff_zero",
      "provenance": {"rlaudit": "0.1.0", "torch": "2.13.0+cpu", "dtype": "float64",
                     "model_sha": "...", "rollout_sha": "...", "blessed_at": "..."},
      "backends": {
        "reference@cpu": {"steps": [{"actor/pg_loss": {"value": 0.0123, "rtol": 1e-06,
                                                       "atol": 1e-09}, ...}, ...]},
        "fsdp@cpu": {...}
      }
    }

Rules (pytest-regressions/syrupy habits): regeneration is explicit (``rlaudit golden bless``)
and a blessing run still exits non-zero; a mismatch writes ``<scenario>.obtained.json`` beside
the golden; a golden whose model or rollout hash no longer matches is *stale* and is not
compared; files are written atomically.
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import os
import tempfile
from pathlib import Path

import torch

import rlaudit
from rlaudit.data.io import rollout_sha256
from rlaudit.metrics import golden_names
from rlaudit.model.load import snapshot_id
from rlaudit.scenarios.result import GoldenResult
from rlaudit.scenarios.spec import Scenario, Tolerance

#: golden tolerances by dtype, looser than same-machine parity: goldens travel across BLAS
#: builds and CPUs, where summation order differs
GOLDEN_TOLERANCES = {"float64": (1e-6, 1e-9), "float32": (2e-4, 1e-6), "bfloat16": (5e-2, 5e-2)}


def golden_path(golden_dir: Path, scn: Scenario) -> Path:
    return golden_dir / f"{scn.name}.json"


def obtained_path(golden_dir: Path, scn: Scenario) -> Path:
    return golden_dir / f"{scn.name}.obtained.json"


def backend_key(backend: str, device: str) -> str:
    return f"{backend}@{device}"


def provenance(scn: Scenario) -> dict:
    return {"rlaudit": rlaudit.__version__, "torch": torch.__version__, "dtype": scn.dtype,
            "model_sha": snapshot_id(scn.model), "rollout_sha": rollout_sha256(scn.rollout)}


def _tol(scn: Scenario, name: str) -> Tolerance:
    """The scenario's own tolerance for ``name`` (or its ``default``), else the golden default
    for the dtype (looser than same-machine parity: goldens travel across machines)."""
    if name in scn.tolerances:
        return scn.tolerances[name]
    if "default" in scn.tolerances:
        return scn.tolerances["default"]
    rtol, atol = GOLDEN_TOLERANCES[scn.dtype]
    return Tolerance(rtol, atol)


def golden_document(scn: Scenario, runs: dict) -> dict:
    doc = {"scenario": scn.name,
           "provenance": {**provenance(scn),
                          "blessed_at": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")},
           "backends": {}}
    for backend, variants in sorted(runs.items()):
        steps = []
        for metrics in variants["base"].steps:
            entry = {}
            for name in golden_names(metrics):
                t = _tol(scn, name)
                entry[name] = {"value": metrics[name], "rtol": t.rtol, "atol": t.atol}
            steps.append(entry)
        doc["backends"][backend_key(backend, scn.device)] = {"steps": steps}
    return doc


def write_json_atomic(path: Path, doc: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(doc, f, indent=1, sort_keys=True)
            f.write("\n")
        os.chmod(tmp, 0o644)  # mkstemp creates 0600; goldens are ordinary committed files
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def read_golden(path: Path) -> dict:
    """Load and check a golden file's structure (it is hand-editable): InputError naming the file
    and the key of the first malformed entry."""
    from rlaudit.errors import InputError
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise InputError(f"golden file is not valid JSON: {e}", source=str(path)) from None

    def bad(key, msg):
        raise InputError(msg, source=str(path), key=key)
    if not isinstance(doc, dict):
        bad(None, "expected a JSON object at the top level")
    if not isinstance(doc.get("provenance", {}), dict):
        bad("provenance", "expected an object")
    if not isinstance(doc.get("backends", {}), dict):
        bad("backends", "expected an object backend@device -> {steps: [...]}")
    for key, entry in doc.get("backends", {}).items():
        if not isinstance(entry, dict) or not isinstance(entry.get("steps"), list):
            bad(f"backends.{key}", "expected an object with a list 'steps'")
        for i, step in enumerate(entry["steps"]):
            if not isinstance(step, dict):
                bad(f"backends.{key}.steps[{i}]", "expected an object metric -> {value, rtol, atol}")
            for name, w in step.items():
                where = f"backends.{key}.steps[{i}].{name}"
                if not isinstance(w, dict) or not {"value", "rtol", "atol"} <= set(w):
                    bad(where, "expected an object with value, rtol and atol")
                for k in ("value", "rtol", "atol"):
                    if isinstance(w[k], bool) or not isinstance(w[k], (int, float)):
                        bad(f"{where}.{k}", f"expected a number, got {w[k]!r}")
    return doc


def compare(golden: dict, metrics_by_step: list[dict[str, float]]
            ) -> tuple[list[dict], float, list[dict]]:
    """(mismatches, worst relative drift, rows): one row per compared (step, metric) with value,
    golden, rtol, atol, drift (relative) and ok."""
    mismatches, worst, rows = [], 0.0, []
    want_steps = golden["steps"]
    if len(want_steps) != len(metrics_by_step):
        mismatches.append({"metric": "*", "step": None, "message":
                           f"{len(metrics_by_step)} steps run, golden has {len(want_steps)}"})
    for step, (want, got) in enumerate(zip(want_steps, metrics_by_step)):
        got_names = set(golden_names(got))
        for name in sorted(set(want) | got_names):
            if name not in got_names:
                mismatches.append({"metric": name, "step": step, "message": "missing from the run"})
                continue
            if name not in want:
                mismatches.append({"metric": name, "step": step,
                                   "message": "not in the golden (new metric)", "value": got[name]})
                continue
            w = want[name]
            value, ref = got[name], w["value"]
            drift = abs(value - ref) / max(abs(ref), 1e-12)
            if math.isfinite(drift):
                worst = max(worst, drift)
            bound = w["atol"] + w["rtol"] * abs(ref)
            rows.append({"metric": name, "step": step, "value": value, "golden": ref,
                         "rtol": w["rtol"], "atol": w["atol"], "drift": drift,
                         "ok": abs(value - ref) <= bound})
            if not (abs(value - ref) <= bound):  # NaN fails too
                mismatches.append({"metric": name, "step": step, "value": value, "golden": ref,
                                   "abs_diff": abs(value - ref), "bound": bound,
                                   "message": f"{value:.10g} vs golden {ref:.10g} "
                                              f"(|diff| {abs(value - ref):.3g} > {bound:.3g})"})
    return mismatches, worst, rows


def compare_or_bless(scn: Scenario, runs: dict, golden_dir: Path, *, bless: bool
                     ) -> list[GoldenResult]:
    path = golden_path(golden_dir, scn)
    if bless:
        doc = golden_document(scn, runs)
        if path.exists():  # keep other backends' entries (e.g. GPU ones) when blessing a subset
            old = read_golden(path)
            doc["backends"] = {**old.get("backends", {}), **doc["backends"]}
        write_json_atomic(path, doc)
        _update_obtained(golden_dir, scn, runs, failing=set())
        return [GoldenResult(b, "blessed", f"wrote {path}") for b in runs]
    if not path.exists():
        return [GoldenResult(b, "missing", f"no golden file {path}; create it with "
                                           f"`rlaudit golden bless {scn.name}`") for b in runs]
    golden = read_golden(path)
    prov = provenance(scn)
    stale = [k for k in ("model_sha", "rollout_sha")
             if golden.get("provenance", {}).get(k) != prov[k]]
    if stale:
        return [GoldenResult(b, "stale", f"golden {path} was blessed for a different "
                                         f"{' and '.join(s.split('_')[0] for s in stale)}; "
                                         f"re-bless it") for b in runs]
    results, obtained = [], {}
    for backend, variants in sorted(runs.items()):
        key = backend_key(backend, scn.device)
        entry = golden.get("backends", {}).get(key)
        if entry is None:
            results.append(GoldenResult(backend, "missing", f"golden has no entry {key}"))
            continue
        mismatches, worst, rows = compare(entry, variants["base"].steps)
        if mismatches:
            obtained[key] = True
            first = mismatches[0]
            results.append(GoldenResult(backend, "fail", f"{len(mismatches)} mismatch(es); first: "
                                        f"{first['metric']} step {first['step']}: "
                                        f"{first['message']}", mismatches, worst, rows))
        else:
            results.append(GoldenResult(backend, "pass", "", [], worst, rows))
    _update_obtained(golden_dir, scn, runs, failing=set(obtained))
    return results


def _update_obtained(golden_dir: Path, scn: Scenario, runs: dict, *, failing: set[str]) -> None:
    """``<scenario>.obtained.json`` holds the obtained values of every backend whose last
    comparison failed: this call's backends are replaced (kept if failing, dropped if not),
    other backends' entries stay (items of one scenario may run apart, e.g. under xdist). The
    file is removed once no backend is failing."""
    path = obtained_path(golden_dir, scn)
    compared = {backend_key(b, scn.device) for b in runs}
    kept = {}
    if path.exists():
        try:
            kept = {k: v for k, v in json.loads(path.read_text()).get("backends", {}).items()
                    if k not in compared}
        except (json.JSONDecodeError, AttributeError):
            kept = {}  # an unreadable obtained file is only a debugging aid: start afresh
    doc = golden_document(scn, runs) if failing else {"scenario": scn.name, "backends": {}}
    backends = {**kept, **{k: v for k, v in doc["backends"].items() if k in failing}}
    if backends:
        write_json_atomic(path, {**doc, "backends": backends})
    else:
        path.unlink(missing_ok=True)
