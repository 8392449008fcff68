"""An adapter's ``train_step`` as a backend: each scenario variant becomes one ``train_step``
call, and what it returns becomes the :class:`~rlaudit.backends.base.VariantRun` the run-level
invariants read (the backend's name is the adapter's name).

What a run holds depends on what the adapter returned (:class:`TrainStepOutput`); an invariant
that needs data the adapter did not return is reported n/a, never passed. :data:`NEEDS` lists,
per invariant, what it reads from a run; :func:`missing` says what is absent. Invariants not
listed read only metrics and the input batch.

An adapter with a ``replay(request)`` method (rlaudit's own backends, see contract/own_adapters.py)
is handed the whole request instead. Variants whose config the adapter does not ``supports`` are
skipped and recorded in :attr:`TargetBackend.skipped`; a variant whose ``train_step`` raised
:class:`~rlaudit.verdict.unsupported.UnsupportedFeature` (the release lacks what it needs) is
skipped too, and recorded in :attr:`TargetBackend.unsupported` as well. A self-filtering
target whose own group filter keeps other rows than the reference's is recorded in
:attr:`TargetBackend.diverged` and run again on the reference's rows with the filter off
(rlaudit/targets/run/upstream.py names the first stage that differs).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch

from rlaudit.backends.base import ReplayRequest, Variant, VariantRun
from rlaudit.backends.replay import RECORDED_FIELDS
from rlaudit.config import Config
from rlaudit.data.batch import KNOWN_FIELDS, RolloutBatch
from rlaudit.errors import InputError
from rlaudit.heap import freeze_long_lived
from rlaudit.targets.contract.adapter import (TrainStepOutput, adapter_name, metric_floats,
                                              supports)
from rlaudit.targets.contract.guard import batch_state, unchanged_since
from rlaudit.targets.run.upstream import RowsKept, filter_off
from rlaudit.update.plan import describe_micro
from rlaudit.verdict.unsupported import UnsupportedFeature
from rlaudit.backends.reference import DTYPES
from rlaudit.model.load import load_model

#: keys of a micro-batch description (rlaudit.update.plan.describe_micro)
DESCRIPTION_KEYS = {"rows", "tokens", "padding", "fields"}


# ---- micro-batches ---------------------------------------------------------------------------

def describe(micro: Any, kinds: Mapping, source: str) -> dict:
    """A micro-batch record (RolloutBatch, rlaudit-named tensor dict or description) as
    :func:`~rlaudit.update.plan.describe_micro`'s dict. A tensor dict counts as padding when its
    response mask has no True entry."""
    if isinstance(micro, RolloutBatch):
        return describe_micro(micro)
    if isinstance(micro, Mapping) and set(micro) == DESCRIPTION_KEYS:
        return dict(micro)
    if isinstance(micro, Mapping) and "response_mask" in micro:
        mask = micro["response_mask"]
        fields = {}
        for k, v in sorted(micro.items()):
            kind = kinds.get(k) or (KNOWN_FIELDS[k].kind if k in KNOWN_FIELDS else None)
            fields[k] = [getattr(kind, "value", "token" if v.dim() >= 2 else "seq"),
                         str(v.dtype).replace("torch.", ""), list(v.shape[1:])]
        tokens = int(mask.bool().sum())
        return {"rows": int(mask.shape[0]), "tokens": tokens, "padding": tokens == 0,
                "fields": fields}
    raise InputError("a micro-batch record must be a RolloutBatch, a dict of rlaudit-named "
                     f"tensors with response_mask, or a describe_micro() dict; got "
                     f"{type(micro).__name__}", source=source, key="microbatches")


# ---- TrainStepOutput -> VariantRun -----------------------------------------------------------

@functools.lru_cache(maxsize=4)
def _initial_params(model_path: str, dtype: str) -> tuple[tuple[str, ...], torch.Tensor]:
    model = load_model(model_path, dtype=DTYPES[dtype])
    params = dict(model.named_parameters())
    names = tuple(sorted(params))
    return names, torch.cat([params[n].detach().double().flatten() for n in names])


def to_variant_run(variant: Variant, out: TrainStepOutput, *, source: str,
                   model_path: str | None = None, dtype: str = "float32") -> VariantRun:
    """Validate ``out`` (shapes, step count, names) and lay it out as a VariantRun."""
    if not isinstance(out, TrainStepOutput):
        raise InputError(f"expected a TrainStepOutput, got {type(out).__name__}", source=source)
    if len(out.metrics) != variant.steps:
        raise InputError(f"{len(out.metrics)} metric dicts for steps={variant.steps}",
                         source=source, key="metrics")
    run = VariantRun(name=variant.name,
                     steps=[metric_floats(m, source) for m in out.metrics])
    shape = tuple(variant.batch.mask.shape)
    per_token = {"probe_log_probs": out.log_probs, "probe_entropy": out.entropy}
    unknown = sorted(set(out.tokens) - set(RECORDED_FIELDS))
    if unknown:
        raise InputError(f"unknown per-token field(s) {unknown}; valid: "
                         f"{', '.join(RECORDED_FIELDS)}", source=source, key="tokens")
    per_token.update(out.tokens)
    for name, t in per_token.items():
        if t is None:
            continue
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != shape:
            raise InputError(f"expected a [B, R] = {list(shape)} tensor, got "
                             f"{getattr(t, 'shape', type(t).__name__)}", source=source, key=name)
        run.tokens[name] = t.detach().cpu().clone()
    dtypes = {p.dtype for step in out.params for p in step.values()
              if isinstance(p, torch.Tensor)}
    if dtypes:   # the narrowest, for identities over parameter deltas (grad-norm-identity)
        run.info["param_dtype"] = str(min(dtypes, key=lambda d: torch.finfo(d).bits))
    for step, params in enumerate(out.params):
        names = sorted(params)
        run.param_names = names
        run.param_numels = [params[n].numel() for n in names]
        run.params.append(torch.cat([params[n].detach().cpu().double().flatten()
                                     for n in names]))
        run.param_norms.append({n: float(params[n].detach().double().norm()) for n in names})
    if run.params and model_path is not None:
        names, flat = _initial_params(str(model_path), dtype)
        if list(names) == run.param_names:
            run.params_initial = flat.clone()
    kinds = dict(variant.batch.kinds)
    run.micro_log = [[[[describe(m, kinds, source) for m in _seq(opt, source)]
                       for opt in _seq(rank, source)] for rank in _seq(step, source)]
                     for step in _seq(out.microbatches, source)]
    run.info["returned"] = sorted(k for k, v in (("metrics", True),
                                                 ("params", bool(out.params)),
                                                 ("microbatches", bool(out.microbatches)))
                                  if v) + sorted(run.tokens)
    return run


def _rows_kept(out: Any) -> int | None:
    """The row count of ``out``'s per-token tensors (what a self-filtering target's own group
    filter kept), or None when it returned none or inconsistent ones (to_variant_run says so)."""
    rows = {int(t.shape[0]) for t in (getattr(out, "log_probs", None),
                                      getattr(out, "entropy", None),
                                      *(getattr(out, "tokens", None) or {}).values())
            if isinstance(t, torch.Tensor) and t.dim() == 2}
    return rows.pop() if len(rows) == 1 else None


def _seq(x: Any, source: str) -> list:
    """One level of TrainStepOutput.microbatches (steps > ranks > optimizer steps > micros)."""
    if not isinstance(x, (list, tuple)):
        raise InputError("expected nested lists: per step, per rank, per optimizer step, the "
                         f"micro-batches; found a {type(x).__name__} at a list level",
                         source=source, key="microbatches")
    return list(x)


class TargetBackend:
    """:class:`~rlaudit.backends.base.Backend` over an adapter (see the module docstring)."""

    def __init__(self, adapter: object):
        self.adapter = adapter
        self.name = adapter_name(adapter)
        self.skipped: dict[str, str] = {}
        #: per variant name, what the release lacks to run it (also in ``skipped``)
        self.unsupported: dict[str, UnsupportedFeature] = {}
        #: per variant name, the batch handed to the adapter instead of the variant's own (the
        #: unfiltered rows for a self-filtering target: rlaudit/targets/inputs/dynamic_sampling.py);
        #: outputs are still laid out and checked against the variant's batch
        self.inputs: dict[str, RolloutBatch] = {}
        #: per variant name, where the target's own group filter kept other rows than the
        #: reference's (its run is then the one on the reference's rows, the filter off)
        self.diverged: dict[str, RowsKept] = {}

    def available(self) -> tuple[bool, str]:
        fn = getattr(self.adapter, "available", None)
        return fn() if callable(fn) else (True, "")

    def replay(self, request: ReplayRequest) -> dict[str, VariantRun]:
        todo = []
        replay = getattr(self.adapter, "replay", None)
        declared_cp = int((getattr(self.adapter, "layout", None) or {}).get("cp", 1))
        for v in request.variants:
            if v.name in self.skipped:      # set beforehand (e.g. dynamic_sampling)
                continue
            ok, why = supports(self.adapter, v.config)
            if ok and v.config.actor.context_parallel_size > 1 and declared_cp <= 1 \
                    and not callable(replay):
                ok, why = False, ("the adapter's layout declares no `cp` (context parallelism; "
                                  "see docs/targets.md)")
            if ok:
                todo.append(v)
            else:
                self.skipped[v.name] = why
        if callable(replay):
            todo = [dataclasses.replace(v, batch=self.inputs.get(v.name, v.batch)) for v in todo]
            return replay(dataclasses.replace(request, variants=todo))
        runs = {}
        for v in todo:
            try:
                run = self._run(request, v)
            except UnsupportedFeature as e:   # the adapter said it: not the trainer failing
                self.skipped[v.name], self.unsupported[v.name] = str(e), e
                continue
            if run is not None:
                runs[v.name] = run
        return runs

    def _run(self, request: ReplayRequest, variant: Variant) -> VariantRun | None:
        batch = self.inputs.get(variant.name, variant.batch)
        out, unchanged = self._train_step(request, variant, batch, variant.config)
        if variant.name in self.inputs:
            kept = _rows_kept(out)
            if kept is not None and kept != len(variant.batch):
                # its filter kept other rows: a finding named by upstream.first_difference; the
                # variant is run again on the reference's rows, the filter off, so that every
                # check downstream of the filter still compares row for row
                fg = variant.config.algorithm.filter_groups
                self.diverged[variant.name] = RowsKept(kept, len(batch), len(variant.batch),
                                                       fg.metric)
                config = filter_off(variant.config)
                ok, why = supports(self.adapter, config)
                if not ok:
                    self.skipped[variant.name] = (
                        f"{self.diverged[variant.name].describe()}, and the run on the "
                        f"reference's rows with the filter off is not supported: {why}")
                    return None
                batch = variant.batch
                out, again = self._train_step(request, variant, batch, config)
                unchanged = unchanged and again
        run = to_variant_run(variant, out, source=f"{self.name}.train_step",
                             model_path=request.model, dtype=request.dtype)
        run.inputs_unchanged = unchanged
        return run

    def _train_step(self, request: ReplayRequest, variant: Variant, batch: RolloutBatch,
                    config: Config) -> tuple[TrainStepOutput, bool]:
        """The adapter's ``train_step`` of ``variant`` on ``batch`` under ``config``, and
        whether it left ``batch`` unchanged."""
        before = batch_state(batch)
        torch.manual_seed(config.trainer.seed)
        out = self.adapter.train_step(model_path=request.model, ref_model_path=request.ref_model,
                                      batch=batch, config=config,
                                      steps=variant.steps, device=request.device)
        # what a trainer imports in its first step (TRL's adapter: TRL, accelerate, datasets)
        # stays off the full collections its later steps ask for (rlaudit/heap.py)
        freeze_long_lived()
        return out, unchanged_since(batch, before)


def replayed_runs(request: ReplayRequest, variants: list[Variant],
                  train_all: Callable[[list[Variant]], list[TrainStepOutput]], *,
                  source: str) -> dict[str, VariantRun]:
    """An adapter's ``replay``: ``train_all(variants)`` runs every variant in one go (one group
    of ranks, the trainer imported once) and returns one TrainStepOutput each, laid out as
    :func:`to_variant_run` lays out ``train_step``'s, with ``inputs_unchanged`` from the batches
    as they were before the run."""
    before = [batch_state(v.batch) for v in variants]
    outs = train_all(variants)
    runs = {}
    for v, out, state in zip(variants, outs, before, strict=True):
        runs[v.name] = to_variant_run(v, out, source=source, model_path=request.model,
                                      dtype=request.dtype)
        runs[v.name].inputs_unchanged = unchanged_since(v.batch, state)
    return runs


# ---- what each invariant reads ---------------------------------------------------------------

@dataclass(frozen=True)
class Needs:
    """What an invariant reads from a run beyond metrics: per-token tensors (always, or
    depending on the variant's config), logged metric names (in any variant), the updated
    parameters, micro-batch records."""

    tokens: tuple[str, ...] = ()
    tokens_for: Callable[[Config], tuple[str, ...]] | None = None
    metrics: tuple[str, ...] = ()
    params: bool = False
    microbatches: bool = False


def _pg_loss_inputs(cfg: Config) -> tuple[str, ...]:
    """What the closed-form pg_loss (identities.expected_pg_loss) and the entropy recomputation
    read for a variant's config."""
    need = ["advantages"]
    if cfg.compute_entropy:
        need.append("probe_entropy")
    if cfg.actor.rollout_correction.rollout_is is not None:
        need.append("rollout_is_weights")
    if cfg.actor.loss_mode == "cispo":
        need.append("probe_log_probs")
    return tuple(need)


NEEDS: dict[str, Needs] = {
    "entropy-logged-when-coeff-zero": Needs(tokens=("probe_entropy",),
                                            metrics=("actor/pg_loss",)),
    "stored-kl-unaltered": Needs(tokens=("kl", "old_log_probs", "ref_log_probs",
                                         "token_level_rewards")),
    "on-policy-identities": Needs(tokens_for=_pg_loss_inputs),
    "config-effect": Needs(tokens_for=lambda cfg: tuple(t for t in _pg_loss_inputs(cfg)
                                                        if t != "probe_entropy"),
                           metrics=("actor/loss", "actor/pg_loss")),
    "grad-norm-identity": Needs(params=True, metrics=("actor/grad_norm",)),
    "rollout-parity": Needs(tokens=("probe_log_probs",)),
    "rollout-correction": Needs(tokens=("probe_log_probs",)),
    "ppo-epochs-identity": Needs(params=True, metrics=("actor/grad_norm",)),
    "kl-loss-direction": Needs(metrics=("actor/kl_loss", "actor/grad_norm")),
    "reward-shaping": Needs(tokens=("token_level_scores",)),
    "batch-invariance": Needs(tokens=("probe_log_probs",)),
    "padding-microbatches-complete": Needs(microbatches=True),
    "distributed-health": Needs(microbatches=True),
}


def missing(invariant: str, runs: Mapping[str, VariantRun], configs: Mapping[str, Config],
            metric_names: set[str]) -> str | None:
    """Why ``runs`` (the adapter's runs of the variants ``invariant`` reads, by name) lack what
    it needs, or None. ``metric_names``: every name the adapter logs in any variant."""
    need = NEEDS.get(invariant)
    if need is None:
        return None
    absent: list[str] = []
    for name, run in runs.items():
        want = need.tokens + (need.tokens_for(configs[name]) if need.tokens_for else ())
        for tok in want:
            if tok not in run.tokens:
                absent.append(_what(tok) + f" (variant {name})")
        if need.params and (not run.params or run.params_initial is None):
            absent.append(f"updated parameters by Hugging Face name (variant {name})")
        if need.microbatches and not run.micro_log:
            absent.append(f"micro-batch records (variant {name})")
    for m in need.metrics:
        if m not in metric_names:
            absent.append(f"metric {m}")
    if not absent:
        return None
    absent = list(dict.fromkeys(absent))
    more = f" (+{len(absent) - 2} more)" if len(absent) > 2 else ""
    return f"train_step did not return {'; '.join(absent[:2])}{more}"


def _what(token: str) -> str:
    return {"probe_log_probs": "TrainStepOutput.log_probs",
            "probe_entropy": "TrainStepOutput.entropy"}.get(token, f"tokens[{token!r}]")


__all__ = ["NEEDS", "Needs", "TargetBackend", "describe", "missing", "to_variant_run"]
