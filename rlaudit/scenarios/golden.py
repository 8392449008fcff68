"""Golden metrics: one human-diffable JSON file per scenario under ``golden/``.

    {
      "scenario": "seed_entropy_coeff_zero",
      "configs": {"<config_sha>": {"actor.entropy_coeff": 0.0, ..., "steps": 2}},
      "backends": {
        "reference@cpu": {
          "provenance": {"semantics": 1, "config_sha": "...", "layout": {}, "dtype": "float64",
                         "model_sha": "...", "ref_model_sha": null, "rollout_sha": "...",
                         "rlaudit": "0.1.0", "torch": "2.13.0+cpu", "blessed_at": "..."},
          "steps": [{"actor/pg_loss": {"value": 0.0123, "rtol": 1e-06, "atol": 1e-09}, ...}, ...]},
        "fsdp@cpu": {...}
      }
    }

Rules (pytest-regressions/syrupy habits): regeneration is explicit (``rlaudit golden bless``)
and a blessing run still exits non-zero; a bless is refused (nothing written) when an invariant
failed or a backend crashed in the same run, unless forced; a mismatch writes
``<scenario>.obtained.json`` beside the golden; files are written atomically.

Provenance is kept **per backend entry**, so a bless of some backends never vouches for the
others: an entry whose semantics version, model, reference model, rollout, layout or resolved
config differs from the scenario's now is *stale* and is not compared. The resolved config is the
scenario's full config tree with every default filled in, plus ``steps``, flattened; its canonical
sha256 is ``config_sha`` and the record itself is kept under ``configs`` so a stale message names
the keys that changed. A key the golden does not record (added to rlaudit after the bless) counts
as unchanged while it holds its default; :data:`SEMANTICS_VERSION` is bumped when what a metric
means changes.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import math
import os
import tempfile
from pathlib import Path

import torch
import yaml

import rlaudit
from rlaudit.config import Config
from rlaudit.data.io import rollout_sha256
from rlaudit.dicts import flatten, to_dict
from rlaudit.errors import InputError
from rlaudit.metrics import golden_bound, golden_names
from rlaudit.model.load import snapshot_id
from rlaudit.scenarios.golden_check import check_golden_values, parse_golden_text
from rlaudit.scenarios.spec import Scenario, discover
from rlaudit.verdict.result import (BLESSED, GOLDEN_FAIL, GOLDEN_PASS, NO_GOLDEN, REFUSED, STALE,
                                    GoldenResult)
from rlaudit.verdict.tolerance import Tolerance

#: golden tolerances by dtype, looser than same-machine parity: goldens travel across BLAS
#: builds and CPUs, where summation order differs
GOLDEN_TOLERANCES = {"float64": (1e-6, 1e-9), "float32": (2e-4, 1e-6), "bfloat16": (5e-2, 5e-2)}

#: The version of rlaudit's metric semantics a golden is blessed under. Bump it with any change
#: that alters what a golden-compared metric means (a formula, a reduction, a denominator, a
#: default's effect), even where the committed goldens happen to keep their values: every golden
#: blessed under another version is then STALE and must be re-blessed (and reviewed).
SEMANTICS_VERSION = 1

#: provenance keys whose change makes a golden entry stale, with the word a message uses
STALE_KEYS = (("semantics", "semantics version"), ("model_sha", "model"),
              ("ref_model_sha", "reference model"), ("rollout_sha", "rollout"),
              ("layout", "layout"), ("config_sha", "config"))


def golden_path(golden_dir: Path, scn: Scenario) -> Path:
    return golden_dir / f"{scn.name}.json"


def obtained_path(golden_dir: Path, scn: Scenario) -> Path:
    return golden_dir / f"{scn.name}.obtained.json"


def scenario_name(path: Path) -> str:
    """The name a scenario file's golden is filed under: its ``name`` key, else its file stem
    (as :func:`rlaudit.scenarios.spec.scenario_from_dict` reads it, without validating the rest:
    an unreadable file counts by its stem)."""
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return path.stem
    name = data.get("name") if isinstance(data, dict) else None
    return name if isinstance(name, str) and name else path.stem


def orphan_goldens(golden_dir: Path, scenarios_dir: Path) -> list[Path]:
    """Golden files under ``golden_dir`` filed under a name no scenario under ``scenarios_dir``
    has any more (renamed or deleted scenarios), sorted: nothing compares them, so they rot
    silently. ``<scenario>.obtained.json`` files are mismatch output, not goldens."""
    names = {scenario_name(p) for p in discover(scenarios_dir)} if scenarios_dir.is_dir() else set()
    return [p for p in sorted(golden_dir.glob("*.json"))
            if not p.name.endswith(".obtained.json") and p.stem not in names]


def backend_key(backend: str, device: str) -> str:
    return f"{backend}@{device}"


def config_record(scn: Scenario) -> dict:
    """The resolved config a golden depends on: every config key (defaults filled in) flattened,
    plus ``steps``; JSON-normalised (tuples are lists), as stored under ``configs``."""
    record = {**flatten(to_dict(scn.config)), "steps": scn.steps}
    return json.loads(json.dumps(record, sort_keys=True))


def config_sha(record: dict) -> str:
    """Canonical sha256 of a config record: sorted keys, no whitespace, exact float reprs."""
    text = json.dumps(record, sort_keys=True, separators=(",", ":"), allow_nan=False)
    return hashlib.sha256(text.encode()).hexdigest()


def provenance(scn: Scenario, backend: str | None = None) -> dict:
    """What a golden entry of ``backend`` was produced from (see the module docstring)."""
    return {"semantics": SEMANTICS_VERSION, "rlaudit": rlaudit.__version__,
            "torch": torch.__version__, "dtype": scn.dtype,
            "model_sha": snapshot_id(scn.model),
            "ref_model_sha": snapshot_id(scn.ref_model) if scn.ref_model else None,
            "rollout_sha": rollout_sha256(scn.rollout),
            "config_sha": config_sha(config_record(scn)),
            "layout": dict(scn.backends.get(backend, {})) if backend else {}}


def config_changes(recorded: dict | None, current: dict, *, limit: int = 3) -> list[str]:
    """Human-readable differences between a golden's config record and the scenario's now; keys
    absent from ``recorded`` count only when they differ from rlaudit's default."""
    if recorded is None:
        return ["the golden does not record its config"]
    defaults = json.loads(json.dumps(flatten(to_dict(Config()))))
    out = []
    for key in sorted(set(recorded) | set(current)):
        if key not in current:
            out.append(f"{key} (no longer a config key)")
        elif key not in recorded:
            if key not in defaults or current[key] != defaults[key]:
                out.append(f"{key}: not recorded -> {current[key]!r}")
        elif recorded[key] != current[key]:
            out.append(f"{key}: {recorded[key]!r} -> {current[key]!r}")
    if len(out) > limit:
        out = out[:limit] + [f"{len(out) - limit} more"]
    return out


def stale_reasons(entry_prov: dict | None, configs: dict, scn: Scenario, backend: str,
                  now: dict | None = None) -> list[str]:
    """Why a golden entry cannot vouch for this scenario's ``backend`` now (empty: it can)."""
    now = now or provenance(scn, backend)
    if not entry_prov or "semantics" not in entry_prov:
        return ["it was blessed before goldens recorded the config and the semantics version "
                "per backend"]
    reasons = []
    for key, word in STALE_KEYS:
        if key == "config_sha":
            if entry_prov.get(key) != now[key]:
                changes = config_changes(configs.get(entry_prov.get(key)), config_record(scn))
                if changes:
                    reasons.append(f"config changed ({'; '.join(changes)})")
        elif entry_prov.get(key) != now[key]:
            reasons.append(f"{word} {entry_prov.get(key)!r} -> {now[key]!r}"
                           if key in ("semantics", "layout") else f"a different {word}")
    return reasons


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
    """A golden file's content for ``runs`` (backend -> variant -> VariantRun): each backend's
    base-variant metrics per step with their tolerances and its own provenance."""
    blessed_at = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    record = config_record(scn)
    doc = {"scenario": scn.name, "configs": {config_sha(record): record}, "backends": {}}
    for backend, variants in sorted(runs.items()):
        steps = []
        for metrics in variants["base"].steps:
            entry = {}
            for name in golden_names(metrics):
                t = _tol(scn, name)
                entry[name] = {"value": metrics[name], "rtol": t.rtol, "atol": t.atol}
            steps.append(entry)
        doc["backends"][backend_key(backend, scn.device)] = {
            "provenance": {**provenance(scn, backend), "blessed_at": blessed_at}, "steps": steps}
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
    except OSError as e:  # a full disk's write names no file: this one is named
        Path(tmp).unlink(missing_ok=True)
        raise OSError(e.errno, e.strerror or str(e), str(path)) from e
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def read_golden(path: Path) -> dict:
    """Load and check a golden file's structure (it is hand-editable): InputError naming the file
    and the key of the first malformed entry."""
    try:
        doc = parse_golden_text(path.read_text(encoding="utf-8"), source=str(path))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise InputError(f"golden file is not valid JSON: {e}", source=str(path)) from None

    def bad(key, msg):
        raise InputError(msg, source=str(path), key=key)
    if not isinstance(doc, dict):
        bad(None, "expected a JSON object at the top level")
    for top in ("provenance", "configs"):
        if not isinstance(doc.get(top, {}), dict):
            bad(top, "expected an object")
    for sha, record in doc.get("configs", {}).items():
        if not isinstance(record, dict):
            bad(f"configs.{sha}", "expected an object dotted config key -> value")
    if not isinstance(doc.get("backends", {}), dict):
        bad("backends", "expected an object backend@device -> {steps: [...]}")
    for key, entry in doc.get("backends", {}).items():
        if not isinstance(entry, dict) or not isinstance(entry.get("steps"), list):
            bad(f"backends.{key}", "expected an object with a list 'steps'")
        if not isinstance(entry.get("provenance", {}), dict):
            bad(f"backends.{key}.provenance", "expected an object")
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
    check_golden_values(doc, source=str(path))  # finite, sane tolerances, steps, provenance
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
            bound = golden_bound(ref, w["rtol"], w["atol"])
            rows.append({"metric": name, "step": step, "value": value, "golden": ref,
                         "rtol": w["rtol"], "atol": w["atol"], "drift": drift,
                         "ok": abs(value - ref) <= bound})
            if not (abs(value - ref) <= bound):  # NaN fails too
                mismatches.append({"metric": name, "step": step, "value": value, "golden": ref,
                                   "abs_diff": abs(value - ref), "bound": bound,
                                   "message": f"{value:.10g} vs golden {ref:.10g} "
                                              f"(|diff| {abs(value - ref):.3g} > {bound:.3g})"})
    return mismatches, worst, rows


def bless_blocker(res) -> str | None:
    """Why a run's metrics may not become goldens: the invariants that failed or could not run
    and the backends that crashed in it (None: nothing stands in the way)."""
    bad = [f"{c.invariant} {c.status} on {c.backend}" for c in res.checks if not c.ok]
    bad += [f"backend {b} crashed" for b in res.errors]
    if not bad:
        return None
    more = f" and {len(bad) - 3} more" if len(bad) > 3 else ""
    return (f"this run has {'; '.join(bad[:3])}{more}; fix that first, or pass --force to bless "
            "values that failed their own checks")


def compare_or_bless(scn: Scenario, runs: dict, golden_dir: Path, *, bless: bool,
                     refuse: str | None = None) -> list[GoldenResult]:
    """Compare ``runs`` with the scenario's golden, or with ``bless`` write them into it.

    ``refuse``: why this run may not be blessed (an invariant failed, a backend crashed): the
    bless is refused and nothing is written (rlaudit.scenarios.engine passes it unless forced).
    Blessing a subset of backends keeps the other entries with their own provenance."""
    path = golden_path(golden_dir, scn)
    if bless and refuse:
        return [GoldenResult(b, REFUSED, f"not blessed, {path} left as it was: {refuse}")
                for b in runs]
    if bless:
        doc = golden_document(scn, runs)
        if path.exists():  # keep other backends' entries (e.g. GPU ones) when blessing a subset
            old = read_golden(path)
            doc["backends"] = {**old.get("backends", {}), **doc["backends"]}
            used = {e.get("provenance", {}).get("config_sha") for e in doc["backends"].values()}
            doc["configs"] = {k: v for k, v in {**old.get("configs", {}), **doc["configs"]}.items()
                              if k in used}
        write_json_atomic(path, doc)
        _update_obtained(golden_dir, scn, runs, failing=set())
        return [GoldenResult(b, BLESSED, f"wrote {path}") for b in runs]
    if not path.exists():
        return [GoldenResult(b, NO_GOLDEN, f"no golden file {path}; create it with "
                                           f"`rlaudit golden bless {scn.name}`") for b in runs]
    golden = read_golden(path)
    results, obtained = [], {}
    common = provenance(scn)  # hashes the model and rollout once
    for backend, variants in sorted(runs.items()):
        key = backend_key(backend, scn.device)
        entry = golden.get("backends", {}).get(key)
        if entry is None:
            results.append(GoldenResult(backend, NO_GOLDEN, f"golden {path} has no entry {key}; "
                                        f"add it with `rlaudit golden bless {scn.name} "
                                        f"--backend {backend}`"))
            continue
        now = {**common, "layout": dict(scn.backends.get(backend, {}))}
        prov = entry.get("provenance", golden.get("provenance"))
        reasons = stale_reasons(prov, golden.get("configs", {}), scn, backend, now)
        if reasons:
            results.append(GoldenResult(backend, STALE, f"golden entry {key} of {path} is stale: "
                                        f"{'; '.join(reasons)}; re-bless it (`rlaudit golden "
                                        f"bless {scn.name}`)"))
            continue
        mismatches, worst, rows = compare(entry, variants["base"].steps)
        if mismatches:
            obtained[key] = True
            first = mismatches[0]
            results.append(GoldenResult(backend, GOLDEN_FAIL, f"{len(mismatches)} mismatch(es); "
                                        f"first: {first['metric']} step {first['step']}: "
                                        f"{first['message']}", mismatches, worst, rows))
        else:
            results.append(GoldenResult(backend, GOLDEN_PASS, "", [], worst, rows))
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
