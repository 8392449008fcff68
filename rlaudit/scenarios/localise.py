"""Drift localisation: when a parity or golden check fails, say where — the step, the stage of
the step's data flow, the layer or op of the model and the token (docs/internals.md, "Drift
localisation").

It runs only for a scenario that failed ``backend-parity``/``dp-invariance``, ``rollout-parity``
or a golden comparison; a passing scenario never reaches this module. Per failing backend:

1. **Step and stage** from the runs the checks already read
   (:func:`~rlaudit.scenarios.localise_stages.first_divergence_in_runs`): the failing variant
   (``base`` when it fails) against the reference backend's run of it.
2. Unless that already places the divergence in a batch-preparation stage that involves no
   model at step 0 (scores, KL in reward, rollout IS weights, advantages), **one probe re-run**
   of that variant per side — the failing backend and the reference, each one replay of one
   variant, stopped after the divergent step — records per-stage tensors and hooks every module
   at the start of the divergent step (rlaudit/backends/probe.py). The stage is then placed
   down to the optimizer step
   (:func:`~rlaudit.scenarios.localise_stages.first_divergence_in_probe`), and the model
   comparison (rlaudit/scenarios/localise_layers.py) names the first module out of tolerance:
   forward when the divergence is in log-probs or the loss, backward when it is in the gradients.

A failure with no second run to compare with (the reference's own golden, the sampling engine
vs every trainer) gets step and stage from what it has. Each result is a JSON-able dict in
``ScenarioResult.localisation``; the console, the HTML report and MLflow render it
(rlaudit/report/localise_view.py). Localisation never changes a verdict and never raises: a
problem in it is recorded in the entry's ``error``.
"""

from __future__ import annotations

import dataclasses
import time
import traceback
from typing import Callable

import torch

from rlaudit.backends.base import ReplayRequest, Variant, VariantRun
from rlaudit.backends.probe import DEFAULT_ROWS, ProbeSpec
from rlaudit.backends.registry import get_backend
from rlaudit.scenarios.localise_layers import backward_report, forward_report
from rlaudit.scenarios.localise_stages import (NO_MODEL_STAGES, STAGES, StageReport,
                                               first_divergence_in_probe,
                                               first_divergence_in_runs, metric_stage)
from rlaudit.verdict.compare import compare_runs

ORACLE = "reference"
PARITY_CHECKS = ("backend-parity", "dp-invariance")
ROLLOUT_CHECK = "rollout-parity"
GOLDEN = "golden"
#: stages after which the model is probed backward (forward otherwise)
BACKWARD_STAGES = ("gradients",)
#: stages of the actor update (per-step metrics average them over optimizer steps)
UPDATE_STAGES = ("per-micro-batch loss", "gradients", "grad norm", "parameters after the update")
#: stages whose divergence the forward layer probe explains
FORWARD_STAGES = ("old/ref log-probs", "per-micro-batch loss")

Replay = Callable[[str, ReplayRequest], dict[str, VariantRun]]


def default_replay(backend: str, request: ReplayRequest) -> dict[str, VariantRun]:
    return get_backend(backend).replay(request)


# ---- which failures, against what ----------------------------------------------------------------

def failing_jobs(res) -> tuple[dict[str, list[str]], dict[str, list[str]]]:
    """``(against the reference: backend -> checks, alone: backend -> checks)`` of a result.

    A non-reference backend failing parity, or failing rollout parity / its golden where the
    reference does not, is compared with the reference; a failure the reference shares (its own
    golden, the engine vs every trainer) has nothing to be compared with and is placed alone."""
    status = {(c.invariant, c.backend): c.status for c in res.checks}
    golden = {g.backend: g.status for g in res.golden}
    ref_rollout_fails = status.get((ROLLOUT_CHECK, ORACLE)) == "fail"
    ref_golden_fails = golden.get(ORACLE) == "fail"
    pair: dict[str, list[str]] = {}
    alone: dict[str, list[str]] = {}
    for c in res.checks:
        if c.status != "fail":
            continue
        if c.invariant in PARITY_CHECKS and c.backend != ORACLE:
            pair.setdefault(c.backend, []).append(c.invariant)
        elif c.invariant == ROLLOUT_CHECK:
            target = alone if (c.backend == ORACLE or ref_rollout_fails) else pair
            target.setdefault(c.backend, []).append(c.invariant)
    for b, st in golden.items():
        if st == "fail":
            target = alone if (b == ORACLE or ref_golden_fails) else pair
            target.setdefault(b, []).append(GOLDEN)
    for b in pair:  # compared with the reference: its rollout/golden failures are explained there
        alone.pop(b, None)
    return pair, alone


def failing_variant(ctx, backend: str, oracle: dict | None = None) -> str | None:
    """The first variant (``base`` first) on which ``backend`` and the reference (or ``oracle``:
    variant -> run, e.g. the reference narrowed to what a target reports) disagree."""
    names = [v.name for v in ctx.variants]
    names = (["base"] if "base" in names else []) + [n for n in names if n != "base"]
    for v in names:
        got = ctx.run(backend, v)
        want = ctx.run(ORACLE, v) if oracle is None else oracle.get(v)
        if got is None or want is None:
            continue
        if not compare_runs(ctx.scenario, got, want, mask=ctx.mask(v)).ok:
            return v
    return None


# ---- the entries ---------------------------------------------------------------------------------

def _probe_rows(report: StageReport, n_rows: int) -> tuple[int, ...]:
    """The rows of the worst per-token entries of the first divergence, then the first rows,
    up to DEFAULT_ROWS (sorted)."""
    rows: list[int] = []
    for d in report.divergences:
        for w in d.worst:
            idx = w.get("index") or []
            if len(idx) == 2 and idx[0] not in rows:
                rows.append(int(idx[0]))
    for r in range(n_rows):
        if len(rows) >= min(DEFAULT_ROWS, n_rows):
            break
        if r not in rows:
            rows.append(r)
    return tuple(sorted(rows[:DEFAULT_ROWS]))


def _role(report: StageReport) -> str:
    names = {d.quantity for d in report.divergences}
    return "ref" if names == {"ref_log_probs"} else "actor"


def entry_summary(entry: dict) -> str:
    if entry.get("step") is None:
        return entry.get("note") or "no divergence found"
    where = f"step {entry['step']}"
    if entry.get("optimizer_step") is not None:
        where += f" (optimizer step {entry['optimizer_step']})"
    text = f"{where}, stage \"{entry['stage']}\""
    layers = entry.get("layers") or {}
    if layers.get("module"):
        text += f", first module out of tolerance ({layers['direction']}): {layers['module']}"
    elif layers.get("curve") and layers["direction"] == "forward" and (
            entry["stage"] == "old/ref log-probs" or (entry["stage"] == "per-micro-batch loss"
                                                      and entry.get("optimizer_step") is not None)):
        text += (", every module output agrees: the divergence enters after the LM head "
                 "(log-probs from the logits, or the loss)")
    elif entry["stage"] in NO_MODEL_STAGES and entry["step"] == 0:
        text += " (before any model op: old/ref log-probs agree)"
    return text


def _stage_entry(entry: dict, report: StageReport | None) -> dict:
    if report is None:
        entry.update(step=None, stage=None, optimizer_step=None)
        return entry
    entry.update(report.to_json())
    return entry


def pair_entry(scn, backend: str, checks: list[str], variant: Variant, got: VariantRun,
               want: VariantRun) -> tuple[dict, ProbeSpec | None]:
    """Phase 1 for a backend compared with the reference: the entry and, when the model must be
    probed, the probe to run on both sides."""
    entry = {"backend": backend, "against": ORACLE, "checks": checks, "variant": variant.name}
    report = first_divergence_in_runs(scn, got, want, variant.batch.mask)
    _stage_entry(entry, report)
    if report is None or report.stage is None:
        entry["note"] = (f"no numeric divergence from {ORACLE} on variant {variant.name}"
                         + (": the failure is structural" if report is not None else ""))
        return entry, None
    if report.stage in NO_MODEL_STAGES and report.step == 0:
        return entry, None
    if report.stage in UPDATE_STAGES:
        entry["note"] = (f"placed from per-step metrics, which average step {report.step}'s "
                         f"optimizer steps: the update of that step diverges; which optimizer "
                         f"step, and whether loss, gradient or parameter update first, needs "
                         f"per-optimizer-step records (the probe re-run)")
    return entry, ProbeSpec(target_step=report.step, rows=_probe_rows(report, len(variant.batch)),
                            role=_role(report))


def finish_with_probe(scn, entry: dict, mask: torch.Tensor, got: dict, want: dict) -> dict:
    """Phase 2: refine the stage with both probe records and compare the model module by module
    (backward when the gradients are the first divergence, forward otherwise)."""
    report = first_divergence_in_probe(scn, got, want, mask)
    if report is not None:
        _stage_entry(entry, report)
        entry.pop("note", None)
    else:
        entry["note"] = ("the probe re-run found no divergence up to step "
                         f"{got['spec']['target_step']}: the stage above comes from the "
                         f"original runs")
    stage = entry.get("stage")
    if stage == "parameters after the update" and report is not None:
        entry["update"] = update_ratio(got, want, report)
    gl, wl = got.get("layers"), want.get("layers")
    if not gl or not wl or "error" in gl or "error" in wl:
        return entry
    forward = forward_report(scn, gl, wl)
    if stage in BACKWARD_STAGES and gl.get("param_grads") is not None \
            and wl.get("param_grads") is not None:
        entry["layers"] = backward_report(scn, gl, wl)
        entry["layers"]["forward_module"] = forward.get("module")
        return entry
    entry["layers"] = forward
    if stage in BACKWARD_STAGES:
        forward["note"] = "parameter gradients were not recorded by this backend"
    elif stage not in FORWARD_STAGES:
        forward["note"] = (f"the first divergence is in \"{stage}\", not in the model's "
                           f"forward: module outputs shown for reference")
    return entry


def update_ratio(got: dict, want: dict, report: StageReport) -> dict | None:
    """How the divergent optimizer step's parameter update compares: quantiles of
    (after - before)_got / (after - before)_want over entries whose update is not negligible
    (> 1e-3 of the largest). A ratio that is the same everywhere points at the learning rate or
    another update-wide scale; a spread one at the optimizer's per-parameter state."""
    step, k = report.step, report.optimizer_step or 0

    def before_after(rec):
        opts = rec["steps"][step]["optimizer_steps"]
        if k > 0:
            before = opts[k - 1]["params"]
        elif step > 0:
            before = rec["steps"][step - 1]["optimizer_steps"][-1]["params"]
        else:
            before = rec.get("params_initial")
        return before, opts[k]["params"]

    (gb, ga), (wb, wa) = before_after(got), before_after(want)
    if any(t is None for t in (gb, ga, wb, wa)):
        return None
    dg, dw = (ga - gb).double(), (wa - wb).double()
    keep = dw.abs() > 1e-3 * float(dw.abs().max()) if dw.numel() else dw.bool()
    if not bool(keep.any()):
        return None
    ratio = (dg[keep] / dw[keep]).sort().values
    q = lambda f: float(ratio[min(int(f * (ratio.numel() - 1)), ratio.numel() - 1)])
    return {"median": q(0.5), "p10": q(0.1), "p90": q(0.9), "entries": int(keep.sum())}


def golden_entry(scn, backend: str, checks: list[str], golden) -> dict:
    """Step and stage from a golden comparison's mismatches alone."""
    entry = {"backend": backend, "against": "golden", "checks": checks, "variant": "base"}
    steps = sorted({m["step"] for m in golden.mismatches if m.get("step") is not None})
    if not steps:
        entry.update(step=None, stage=None, optimizer_step=None,
                     note=golden.message or "the golden comparison failed structurally")
        return entry
    step = steps[0]
    at = [m for m in golden.mismatches if m.get("step") == step]
    by_stage = {}
    for m in at:
        by_stage.setdefault(metric_stage(m["metric"]) or "other metrics", []).append(m)
    order = list(STAGES) + ["other metrics"]
    stage = min(by_stage, key=order.index)
    entry.update(step=step, stage=stage, optimizer_step=None, divergences=[
        {"quantity": m["metric"], "stage": stage, "step": step, "message": m.get("message", ""),
         "drift": abs(m["value"] - m["golden"]) / max(abs(m["golden"]), 1e-12)
         if "value" in m and "golden" in m else None, "worst": []}
        for m in by_stage[stage]],
        note="compared with the golden file only (no second run to probe): the metrics "
             "locate the step and stage; the model is not probed")
    return entry


def rollout_entry(ctx, backend: str, checks: list[str]) -> dict:
    """The sampling engine against the trainer's recomputation (step 0, the initial policy):
    worst tokens and the drift by response position."""
    entry = {"backend": backend, "against": "rollout engine", "checks": checks,
             "variant": "base", "step": 0, "stage": "old/ref log-probs", "optimizer_step": None}
    run = ctx.run(backend, "base")
    if run is None or "probe_log_probs" not in run.tokens:
        entry["note"] = "the trainer's log-probs were not recorded"
        return entry
    mask = ctx.batch.mask.bool()
    diff = torch.where(mask, (ctx.batch["rollout_log_probs"].double()
                              - run.tokens["probe_log_probs"].double()).abs(),
                       torch.zeros((), dtype=torch.float64))
    by_pos = diff.amax(0).tolist()
    worst = torch.topk(diff.flatten(), min(5, int(mask.sum()))).indices.tolist()
    entry["divergences"] = [{"quantity": "rollout_log_probs vs probe_log_probs",
                             "stage": "old/ref log-probs", "step": 0, "message": "",
                             "drift": float(diff.max()),
                             "worst": [{"index": list(divmod(i, diff.shape[1])),
                                        "max_abs_diff": float(diff.flatten()[i])}
                                       for i in worst]}]
    entry["by_response_position"] = by_pos
    entry["note"] = ("the reference trainer disagrees with the engine too: the engine and the "
                     "trainer disagree about the policy (temperature, logprobs mode, weights or "
                     "numerics); no backend's model is at fault")
    return entry


# ---- orchestration -------------------------------------------------------------------------------

def localise_scenario(scn, ctx, res, *, timeout: float = 900.0,
                      replay: Replay | None = None) -> list[dict]:
    """Localisation entries for every failing backend of ``res`` (see the module docstring).
    ``replay(backend, request)`` runs a probe re-run (default: the backend's ``replay``)."""
    replay = replay or default_replay
    pair, alone = failing_jobs(res)
    entries: list[dict] = []
    probes: dict[str, tuple[dict, Variant, ProbeSpec]] = {}
    for backend, checks in pair.items():
        try:
            name = failing_variant(ctx, backend)
            if name is None:
                entries.append({"backend": backend, "against": ORACLE, "checks": checks,
                                "step": None, "stage": None, "optimizer_step": None,
                                "note": f"no variant differs from {ORACLE} beyond the "
                                        f"scenario's parity tolerances"})
                continue
            variant = ctx.variant(name)
            entry, spec = pair_entry(scn, backend, checks, variant, ctx.run(backend, name),
                                     ctx.run(ORACLE, name))
            entries.append(entry)
            if spec is not None:
                probes[backend] = (entry, variant, spec)
        except Exception as e:  # never lose the audit result to the localisation
            entries.append(failed_entry(backend, checks, e))
    golden = {g.backend: g for g in res.golden}
    for backend, checks in alone.items():
        try:
            if ROLLOUT_CHECK in checks:
                entries.append(rollout_entry(ctx, backend, checks))
            else:
                entries.append(golden_entry(scn, backend, checks, golden[backend]))
        except Exception as e:
            entries.append(failed_entry(backend, checks, e))
    if probes:
        run_probes(scn, probes, timeout=timeout, replay=replay)
    for e in entries:
        e["summary"] = entry_summary(e)
    return entries


def failed_entry(backend: str, checks: list[str], e: Exception) -> dict:
    return {"backend": backend, "checks": checks, "step": None, "stage": None,
            "optimizer_step": None, "error": f"{type(e).__name__}: {e}",
            "traceback": traceback.format_exc()}


def replay_request(scn, variants: list[Variant], backend: str, timeout: float) -> ReplayRequest:
    return ReplayRequest(model=str(scn.model), variants=variants,
                         ref_model=str(scn.ref_model) if scn.ref_model else None,
                         layout=scn.backends.get(backend, {}), dtype=scn.dtype,
                         device=scn.device, timeout=timeout)


def run_probes(scn, probes: dict[str, tuple[dict, Variant, ProbeSpec]], *, timeout: float,
               replay: Replay) -> None:
    """One re-run per side: the reference replays every distinct probe in one call, each failing
    backend its own variant (under the variant's own name, as it failed)."""
    t0 = time.perf_counter()
    distinct: dict[tuple, str] = {}
    ref_variants = []
    for backend, (entry, variant, spec) in probes.items():
        key = (variant.name, spec)
        if key not in distinct:
            distinct[key] = f"{variant.name}@probe{len(distinct)}"
            ref_variants.append(dataclasses.replace(variant, name=distinct[key], probe=spec))
    try:
        ref_runs = replay(ORACLE, replay_request(scn, ref_variants, ORACLE, timeout))
        ref_error = None
    except Exception as e:
        ref_runs, ref_error = {}, f"{type(e).__name__}: {e}"
    ref_seconds = time.perf_counter() - t0
    for backend, (entry, variant, spec) in probes.items():
        t = time.perf_counter()
        entry["probe"] = {"ran": True, "rows": list(spec.rows), "role": spec.role,
                          "target_step": spec.target_step}
        try:
            if ref_error:
                raise RuntimeError(f"the reference's probe re-run failed: {ref_error}")
            runs = replay(backend, replay_request(scn, [dataclasses.replace(variant, probe=spec)],
                                            backend, timeout))
            got = runs[variant.name].info.get("probe")
            want = ref_runs[distinct[(variant.name, spec)]].info.get("probe")
            if got is None or want is None:
                raise RuntimeError("a probe re-run returned no probe record")
            finish_with_probe(scn, entry, variant.batch.mask, got, want)
        except Exception as e:
            entry["probe"]["error"] = f"{type(e).__name__}: {e}"
            entry["probe"]["traceback"] = traceback.format_exc()
        entry["probe"]["seconds"] = round(time.perf_counter() - t + ref_seconds / len(probes), 2)
