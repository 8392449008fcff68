"""The replay loop every backend shares: probe the initial policy, run ``train_step`` for each
step of a variant, and record metrics, per-token tensors, parameters and micro-batch logs.

Backends supply only ``make_roles(variant) -> Roles`` (their models wrapped in their parallel
contexts); this module never knows how a model is sharded.
"""

from __future__ import annotations

import contextlib
from typing import Callable

import torch

from rlaudit.backends.base import Variant, VariantRun
from rlaudit.backends.probe import ProbeRecorder
from rlaudit.update import forward_memo
from rlaudit.update.actor import compute_log_probs
from rlaudit.update.step import Roles, train_step

#: fields of the prepared batch recorded per token at step 0
RECORDED_FIELDS = ("old_log_probs", "ref_log_probs", "values", "kl", "token_level_scores",
                   "token_level_rewards", "advantages", "returns", "rollout_is_weights")
#: store the full parameter vector only for models up to this many parameters (tiny models)
MAX_PARAMS_RECORDED = 5_000_000


def _fingerprint(batch) -> dict:
    return {k: (v.clone(), v._version) for k, v in batch.tensors.items()}


def _unchanged(batch, before: dict) -> bool:
    for k, (val, version) in before.items():
        t = batch.tensors.get(k)
        if t is None or t._version != version or not torch.equal(t, val):
            return False
    return True


def _flat(params: dict) -> torch.Tensor | None:
    names = sorted(params)
    if sum(params[n].numel() for n in names) > MAX_PARAMS_RECORDED:
        return None
    return torch.cat([params[n].double().flatten() for n in names])


def replay_variant(make_roles: Callable[[Variant], Roles], variant: Variant, *,
                   record_params: bool = True) -> VariantRun:
    probing = getattr(variant, "probe", None) is not None  # its recorder must see every pass
    with forward_memo.paused() if probing else contextlib.nullcontext():
        return _replay_variant(make_roles, variant, record_params=record_params)


def _replay_variant(make_roles: Callable[[Variant], Roles], variant: Variant, *,
                    record_params: bool) -> VariantRun:
    cfg = variant.config
    batch = variant.batch
    before = _fingerprint(batch)
    roles = make_roles(variant)
    run = VariantRun(name=variant.name)
    recorder = None
    if getattr(variant, "probe", None) is not None:  # the drift localisation's re-run only
        recorder = ProbeRecorder(variant.probe)
        roles, batch = recorder.attach(roles, batch)
    if record_params:
        run.params_initial = _flat(roles.actor.full_parameters())
    logp, ent = compute_log_probs(roles.actor, batch, cfg, calc_entropy=True)
    run.tokens["response_mask"] = batch.mask.clone()
    run.tokens["probe_log_probs"] = logp
    run.tokens["probe_entropy"] = ent
    logged = 0
    for step in range(variant.steps if recorder is None else recorder.steps(variant.steps)):
        if recorder is not None:
            recorder.before_step(step, batch, cfg)
        result = train_step(roles, batch, cfg)
        if recorder is not None:
            recorder.after_step(step, result)
        run.steps.append({**result.metrics, **result.timing})
        if step == 0:
            for name in RECORDED_FIELDS:
                if name in result.batch:
                    run.tokens[name] = result.batch[name].detach().cpu().clone()
        params = roles.actor.full_parameters()
        names = sorted(params)
        run.param_norms.append({n: float(params[n].double().norm()) for n in names})
        if record_params and sum(params[n].numel() for n in names) <= MAX_PARAMS_RECORDED:
            run.param_names = names
            run.param_numels = [params[n].numel() for n in names]
            run.params.append(_flat(params))
        run.micro_log.append([roles.actor.micro_log[logged:]])
        logged = len(roles.actor.micro_log)
    run.inputs_unchanged = _unchanged(variant.batch, before)
    if recorder is not None:
        record = recorder.record(run)
        if record is not None:
            run.info["probe"] = record
    return run
