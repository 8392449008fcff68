"""Drift localisation for ``rlaudit run --target``: where the adapter's trainer first leaves the
reference (docs/targets.md, "Where a parity failure starts: probe_model").

Step and stage come from what ``train_step`` returned (metrics per step, per-token tensors of step
0, parameters per step), exactly as for a built-in backend
(:func:`rlaudit.scenarios.localise.pair_entry`). When the divergence is not in a batch-preparation
stage at step 0 and the adapter defines the optional hook ``probe_model``, the model is probed
too: rlaudit runs one hooked pass (forward, and backward under rlaudit's actor loss) of the same
rows through the module the hook returns and through the reference's model at the same step
(one probe re-run of the variant on the reference backend), and compares them module by module.
Without the hook, the entry says so.
"""

from __future__ import annotations

import copy
import dataclasses
import time
import traceback

import torch

from rlaudit.backends.base import Variant
from rlaudit.backends.probe import ProbeSpec, ROW_FIELD, layer_probe
from rlaudit.backends.reference import pad_id, torch_roles
from rlaudit.scenarios import localise as L
from rlaudit.scenarios.localise_layers import backward_report, forward_report
from rlaudit.targets.run.parity import metric_universe, narrowed_reference
from rlaudit.update.context import TorchContext

HOOK = "probe_model"


def _adapter_roles(adapter, scn, variant: Variant, spec: ProbeSpec, device: str):
    """Roles whose actor is the module ``adapter.probe_model`` returns (weights at the start of
    ``spec.target_step``); the reference policy, when the config needs one, is rlaudit's."""
    module = getattr(adapter, HOOK)(model_path=str(scn.model),
                                    ref_model_path=str(scn.ref_model) if scn.ref_model else None,
                                    batch=variant.batch, config=variant.config,
                                    step=spec.target_step, device=device)
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"{HOOK} must return a torch.nn.Module with Hugging Face module names, "
                        f"got {type(module).__name__}")
    roles = torch_roles(str(scn.model), variant, dtype=scn.dtype, device=device,
                        ref_model_path=str(scn.ref_model) if scn.ref_model else None)
    actor = TorchContext(module, None, device=torch.device(device), pad_id=pad_id(str(scn.model)))
    return dataclasses.replace(roles, actor=actor, critic=None)


def target_layers(adapter, scn, variant: Variant, spec: ProbeSpec, want_layers: dict) -> dict:
    """The layer report of the adapter's module against the reference's probe record."""
    roles = _adapter_roles(adapter, scn, variant, spec, scn.device)
    batch = variant.batch.with_fields(kinds={ROW_FIELD: "seq"},
                                      **{ROW_FIELD: torch.arange(len(variant.batch))})
    got = layer_probe(roles, batch, variant.config, spec)
    # ``scn`` is the declared scenario (runner.declared_scenario): its tolerances are floored
    # by the adapter's train precision, so a stock HF float64 model's float32 islands stay inside
    forward = forward_report(scn, got, want_layers)
    if forward.get("module") or got.get("param_grads") is None:
        return forward
    backward = backward_report(scn, got, want_layers)
    if backward.get("module"):
        backward["forward_module"] = None
        return backward
    return forward


def localise_target(adapter, target: str, scn, ctx, res) -> list[dict]:
    """Entries as :func:`rlaudit.scenarios.localise.localise_scenario` makes them, for a target."""
    pair, alone = L.failing_jobs(res)
    entries = []
    golden = {g.backend: g for g in res.golden}
    for backend, checks in alone.items():
        try:
            entries.append(L.rollout_entry(ctx, backend, checks) if L.ROLLOUT_CHECK in checks
                           else L.golden_entry(scn, backend, checks, golden[backend]))
        except Exception as e:
            entries.append(L.failed_entry(backend, checks, e))
    for backend, checks in pair.items():
        try:
            # compared as parity compares a target: the reference narrowed to what it reports
            oracle = narrowed_reference(ctx.runs[L.ORACLE], ctx.runs[backend],
                                        metric_universe(ctx.runs[backend], adapter))
            name = L.failing_variant(ctx, backend, oracle)
            if name is None:
                entries.append({"backend": backend, "against": L.ORACLE, "checks": checks,
                                "step": None, "stage": None, "optimizer_step": None,
                                "note": f"no variant differs from {L.ORACLE} beyond the "
                                        f"scenario's tolerances"})
                continue
            variant = ctx.variant(name)
            entry, spec = L.pair_entry(scn, backend, checks, variant, ctx.run(backend, name),
                                       oracle[name])
            entries.append(entry)
            if spec is None:
                continue
            if not callable(getattr(adapter, HOOK, None)):
                entry["note"] = (f"{target} defines no {HOOK}: step and stage come from what "
                                 f"train_step returned; the model is not probed")
                continue
            t0 = time.perf_counter()
            entry["probe"] = {"ran": True, "rows": list(spec.rows), "role": "actor",
                              "target_step": spec.target_step}
            try:
                spec = dataclasses.replace(spec, role="actor")
                runs = L.default_replay(L.ORACLE, L.replay_request(
                    scn, [dataclasses.replace(variant, probe=spec)], L.ORACLE, 900.0))
                want = runs[variant.name].info["probe"]
                if want.get("layers"):
                    entry["layers"] = target_layers(adapter, scn, copy.copy(variant), spec,
                                                    want["layers"])
            except Exception as e:
                entry["probe"]["error"] = f"{type(e).__name__}: {e}"
                entry["probe"]["traceback"] = traceback.format_exc()
            entry["probe"]["seconds"] = round(time.perf_counter() - t0, 2)
        except Exception as e:
            entries.append(L.failed_entry(backend, checks, e))
    for e in entries:
        e["summary"] = L.entry_summary(e)
    return entries
