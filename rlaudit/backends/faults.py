"""Test-only fault injectors for the built-in backends: one known bug at a time, so that tests can
prove the drift localisation (rlaudit/scenarios/localise.py) names it.

A fault is switched on by the environment variable ``RLAUDIT_FAULT`` in the process that builds
the :class:`~rlaudit.backends.base.ReplayRequest` (its ``faults`` field copies the variable when
the request is made, and travels to the ranks with the request, so warm rank pools started
earlier see it too). Unset — every real run — the backends' hooks return at their first line::

    RLAUDIT_FAULT="megatron:rmsnorm_eps:layer=1,eps=1e-2"            # every variant
    RLAUDIT_FAULT="fsdp/base:lr_scale:factor=1.5;megatron/x:grad_scale:module=model.layers.0.mlp"

Grammar: entries separated by ``;``, each ``BACKEND[/VARIANT]:KIND[:KEY=VALUE,...]``; an entry
without ``/VARIANT`` applies to every variant of that backend. Kinds (:data:`KINDS`):

- ``rmsnorm_eps`` (``layer``, ``norm`` = input|post, ``eps``): that decoder layer's RMSNorm uses
  epsilon ``eps`` (HF: ``variance_epsilon``; megatron: ``torch.nn.RMSNorm.eps``).
- ``softmax_scale`` (``layer``, ``factor``): that layer's attention scores are scaled by
  ``factor`` times the correct 1/sqrt(head_dim) (HF: ``self_attn.scaling``; megatron:
  ``core_attention.softmax_scale``).
- ``grad_scale`` (``module`` = an HF module name, ``tp_rank``, ``factor``): on that tensor-
  parallel rank (megatron only), the gradient of every parameter shard of the module is
  multiplied by ``factor`` as it is produced (the module's backward is wrong on one shard).
- ``lr_scale`` (``factor``, ``rank``): the actor's optimizer steps with ``factor`` x the
  configured learning rate -- on every rank, or only on global rank ``rank`` when given (data-
  parallel replicas then drift apart).
- ``advantage_group`` (``shift``): advantages are computed with the wrong groups: the step sees
  ``uid`` rolled by ``shift`` rows (every group takes one row of its neighbour).

The reference backend never consults faults: it is the oracle.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from rlaudit import switches
from rlaudit.backends.megatron.convert import unwrap_model, module_names_of_stage
from rlaudit.errors import InputError

KINDS = ("rmsnorm_eps", "softmax_scale", "grad_scale", "lr_scale", "advantage_group")
_SOURCE = f"${switches.FAULT}"


def from_env() -> str:
    """The fault spec of this process (empty string when unset): ReplayRequest's default.
    A malformed spec is an InputError here, in the process that builds the request."""
    spec = switches.fault_spec()
    if spec:
        parse(spec)
    return spec


@dataclass(frozen=True)
class Fault:
    backend: str
    kind: str
    variant: str | None = None
    params: dict[str, str] = field(default_factory=dict)

    def get(self, key: str, default: Any, cast: Callable = float) -> Any:
        if key not in self.params:
            return default
        try:
            return cast(self.params[key])
        except ValueError:
            raise InputError(f"{self.kind}: {key}={self.params[key]!r} is not a "
                             f"{cast.__name__}", source=_SOURCE, key=key) from None


def parse(spec: str) -> list[Fault]:
    """Faults of a spec string (see the module docstring); InputError naming the bad entry."""
    out = []
    for entry in filter(None, (e.strip() for e in spec.split(";"))):
        parts = entry.split(":")
        if len(parts) not in (2, 3) or not parts[0] or parts[1] not in KINDS:
            raise InputError(f"expected BACKEND[/VARIANT]:KIND[:K=V,...] with KIND one of "
                             f"{', '.join(KINDS)}, got {entry!r}", source=_SOURCE)
        backend, _, variant = parts[0].partition("/")
        params = {}
        for kv in filter(None, (parts[2] if len(parts) == 3 else "").split(",")):
            key, eq, value = kv.partition("=")
            if not eq:
                raise InputError(f"expected KEY=VALUE, got {kv!r}", source=_SOURCE, key=entry)
            params[key.strip()] = value.strip()
        out.append(Fault(backend, parts[1], variant or None, params))
    return out


def applying(spec: str, backend: str, variant: str) -> list[Fault]:
    """The faults of ``spec`` that apply to ``variant`` on ``backend``."""
    if not spec:
        return []
    return [f for f in parse(spec) if f.backend == backend and f.variant in (None, variant)]


def inject(spec: str, backend: str, variant, make_roles: Callable) -> tuple[Any, Callable]:
    """``(variant, make_roles)`` with the applying faults built in; unchanged when none applies.

    The backends call this once per variant, inside every rank, before ``replay_variant``."""
    faults = applying(spec, backend, variant.name)
    if not faults:
        return variant, make_roles
    for f in faults:
        if f.kind == "advantage_group":
            uid = variant.batch["uid"]
            variant = dataclasses.replace(
                variant, batch=variant.batch.with_fields(uid=uid.roll(f.get("shift", 1, int))))

    def faulty_roles(v):
        roles = make_roles(v)
        for f in faults:
            for role in ("actor", "ref"):
                ctx = getattr(roles, role)
                if ctx is not None:
                    _apply(f, backend, role, ctx)
        return roles

    return variant, faulty_roles


# ---- the injectors ------------------------------------------------------------------------------

def _modules(ctx) -> tuple[dict[str, torch.nn.Module], Callable[[str], str | None]]:
    """(this rank's modules by name, HF module name -> local name or None) for either engine."""
    model = ctx.model
    if hasattr(ctx, "hf_config"):  # megatron: local names through the converter's module map
        inner = unwrap_model(model)
        back = {hf: mg for mg, hf in module_names_of_stage(ctx.hf_config).items()}
        return dict(inner.named_modules()), back.get
    return dict(model.named_modules()), lambda hf: hf


def _layer_part(fault: Fault) -> str:
    layer = fault.get("layer", 0, int)
    if fault.kind == "rmsnorm_eps":
        part = {"input": "input_layernorm", "post": "post_attention_layernorm"}.get(
            fault.get("norm", "input", str))
        if part is None:
            raise InputError("norm must be input or post", source=_SOURCE, key="norm")
    else:
        part = "self_attn"
    return f"model.layers.{layer}.{part}"


def _apply(fault: Fault, backend: str, role: str, ctx) -> None:
    megatron = hasattr(ctx, "hf_config")
    modules, local = _modules(ctx)
    if fault.kind == "lr_scale":
        only = fault.get("rank", None, int)
        if only is not None and torch.distributed.get_rank() != only:
            return
        if role == "actor" and ctx.optimizer is not None:
            for group in ctx.optimizer.param_groups:
                group["lr"] = group["lr"] * fault.get("factor", 1.5)
        return
    if fault.kind in ("rmsnorm_eps", "softmax_scale"):
        name = local(_layer_part(fault))
        module = modules.get(name) if name else None
        if module is None:  # another pipeline stage holds the layer
            return
        if fault.kind == "rmsnorm_eps":
            attr = "eps" if megatron else "variance_epsilon"
            setattr(module, attr, fault.get("eps", 1e-2))
        elif megatron:
            module.core_attention.softmax_scale *= fault.get("factor", 1.25)
        else:
            module.scaling *= fault.get("factor", 1.25)
        return
    if fault.kind == "grad_scale":
        if role != "actor" or not megatron:
            return
        from megatron.core import parallel_state as ps  # lazy: megatron-core: optional, 4 s import
        if ps.get_tensor_model_parallel_rank() != fault.get("tp_rank", 1, int):
            return
        name = local(fault.get("module", "model.layers.0.mlp", str))
        module = modules.get(name) if name else None
        if module is None:
            return
        factor = fault.get("factor", 1.5)
        for p in module.parameters():
            if p.requires_grad:
                p.register_hook(lambda g, f=factor: g * f)
