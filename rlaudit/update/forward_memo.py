"""Forward-only passes answered from a memo, within one backend replay request on the CPU.

A scenario's variants replay the same rollout from the same checkpoints: the reference policy's
log-probs, the probe of the initial policy and the actor's step-0 old log-probs are the same
computation in most of them (``kl_k1``: 31 of the 47 forward-only passes of each backend's
replay). On a CPU box each pass costs collectives (a Megatron TP forward all-reduces per layer;
FSDP all-gathers parameters): ``rlaudit run --all`` took 261 s without the memo, 227 s with it.

:func:`forward_rows` hands back a copy of the first result when a pass's inputs are identical,
bit for bit, to an earlier one's in the same request: the key is a sha256 of everything a
forward-only pass reads --

- the model: every module's type, its parameters, buffers and other tensor attributes (local
  shards, exact bytes), its plain attributes (``training``, ``variance_epsilon``,
  ``softmax_scale``, ...), the config objects it holds, its forward hooks and any method set on
  the instance (qualified name, a partial's arguments, a closure's values and defaults, a bound
  method's object -- FSDP2's state with its mixed-precision policy), and the process-wide
  module hooks;
- the context's plain attributes (ranks, sizes, pad id, device) and its type;
- the batch (``rollout_sha256`` of its tensors, kinds, meta), the forward spec, the output keys
  and the micro-batch plan's settings;
- the process's torch settings (intra-op threads, default dtype, deterministic algorithms,
  autocast, float32 matmul precision, the SDPA backend flags, mkldnn).

A hook or method holding something that cannot be digested makes the pass computed, never
memoised. Out of reach: a library function patched at module level between two passes of one
request (no backend does; a patch made before the replay applies to every pass alike).

Across ranks the key is the digest of every rank's key (an all-gather), and a pass is answered
from the memo only when every rank has it (an all-reduce): the ranks always agree, and a rank
whose shard differs makes every rank recompute. A pass that draws random numbers (from the CPU
generator or megatron's RNG tracker) is never stored: its answer would not repeat, nor would
the generators' states after it.

Scope: :func:`scope` around one request's variants (the three built-in backends), CPU only (a
CUDA pass is not bitwise reproducible, and hashing a GPU model's weights costs more than its
forward); never for the drift localisation's probe re-runs (:func:`paused`); nothing outside a
scope (adapters, tests calling the update functions) is memoised. ``RLAUDIT_FORWARD_MEMO=0``
when a request is made turns it off for that request (``ReplayRequest.forward_memo``).

Results are the same with it on or off, bit for bit (tests/update/test_forward_memo.py, which
also changes each of the inputs above and checks that the pass is recomputed). What it gives up
is re-running an identical computation: a bug that made a second identical forward differ from
the first (state left behind by a pass and read by the next) would show in fewer variants.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import functools
import hashlib
import json
import sys
import threading
import types
from typing import Callable, Iterator

import torch
import torch.distributed as dist
from torch.backends import cuda as sdp  # the SDPA backend flags govern the CPU too
from torch.nn.modules import module as nn_module  # process-wide module hooks

from rlaudit import switches
from rlaudit.data.io import rollout_sha256

_local = threading.local()
#: passes answered from / added to a memo in this process (for tests and benchmarks)
stats = {"hits": 0, "misses": 0, "not_stored": 0}

_PLAIN = (bool, int, float, str, type(None))
#: module attributes every pass sets before it reads them, so their value before a pass cannot
#: change it: megatron's schedules set ``current_microbatch`` on every transformer layer before
#: each micro-batch (``set_current_microbatch``); left in the key, a Megatron model that had run
#: a pass would never match a freshly built one
_SET_BY_EVERY_PASS = frozenset({"current_microbatch"})


def from_env() -> bool:
    """``$RLAUDIT_FORWARD_MEMO``: unset or 1 on, 0 off (ReplayRequest's default)."""
    return switches.forward_memo()


@contextlib.contextmanager
def scope(device, enabled: bool = True) -> Iterator[None]:
    """One request's memo (this thread): on the CPU, when ``enabled``."""
    before = getattr(_local, "memo", None)
    _local.memo = {} if enabled and torch.device(device).type == "cpu" else None
    try:
        yield
    finally:
        _local.memo = before


def paused():
    """Passes in this block (this thread) are computed, never answered from or added to the memo."""
    return scope("cpu", enabled=False)


def forward_rows(ctx, batch, spec, keys: tuple, plan: tuple,
                 compute: Callable[[], tuple]) -> tuple:
    """``compute()`` (a forward-only pass of ``ctx`` over ``batch``), or a copy of its earlier
    result when every input is the same. ``plan``: the micro-batch plan's settings."""
    memo = getattr(_local, "memo", None)
    if memo is None:
        return compute()
    local = _local_key(ctx, batch, spec, keys, plan)
    group, world = _group_of(ctx)
    key = _agreed_key(local, group, world)
    if key is not None:
        have = key in memo
        if world > 1:  # answered from the memo only when every rank has it
            flag = torch.tensor([1 if have else 0], dtype=torch.int64)
            dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
            have = bool(flag.item())
        if have:
            stats["hits"] += 1
            return _copy(memo[key])
    rng = _rng_states()
    out = compute()
    if key is None:
        return out
    after = _rng_states()
    if len(rng) == len(after) and all(map(torch.equal, rng, after)):
        memo[key] = _copy(out)
        stats["misses"] += 1
    else:
        stats["not_stored"] += 1
    return out


def _rng_states() -> list[torch.Tensor]:
    """The CPU generator's state and megatron's RNG tracker's (dropout inside its tensor-parallel
    regions draws from the tracker, which restores the default generator afterwards)."""
    states = [torch.get_rng_state()]
    tracker = sys.modules.get("megatron.core.tensor_parallel.random")
    if tracker is not None:  # CPU generator states (rlaudit/backends/megatron/compat.py)
        tracked = tracker.get_cuda_rng_tracker().get_states()
        states += [tracked[name] for name in sorted(tracked)]
    return states


def _copy(out: tuple) -> tuple:
    return tuple(None if t is None else t.clone() for t in out)


def _group_of(ctx) -> tuple[object, int]:
    """The ranks that run ``ctx``'s passes together: none for a single-process context (the
    reference's, ``distributed=False``), its process group for a data-parallel TorchContext,
    the whole world for Megatron's (TP x PP x DP: every rank runs every pass)."""
    if not (dist.is_available() and dist.is_initialized()):
        return None, 1
    if getattr(ctx, "distributed", True) is False:
        return None, 1
    group = getattr(ctx, "group", None)
    return group, dist.get_world_size(group)


def _agreed_key(local: bytes | None, group, world: int) -> str | None:
    """The request-wide key: this rank's alone, or every rank's (all-gathered). None when some
    rank's inputs cannot be digested (then every rank computes)."""
    if world == 1:
        return None if local is None else local.hex()
    mine = torch.zeros(5, dtype=torch.int64)
    if local is not None:
        mine[0] = 1
        mine[1:] = torch.frombuffer(bytearray(local), dtype=torch.int64)
    every = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(every, mine, group=group)
    if not all(int(t[0]) for t in every):
        return None
    h = hashlib.sha256()
    for t in every:
        h.update(t.numpy().tobytes())
    return h.hexdigest()


# ---- the local key ------------------------------------------------------------------------------

def _local_key(ctx, batch, spec, keys, plan) -> bytes | None:
    h = hashlib.sha256(b"rlaudit-forward-memo-1")
    try:
        head = {"spec": dataclasses.asdict(spec), "keys": list(keys), "plan": list(plan),
                "ctx": [type(ctx).__qualname__, _plain_attrs(ctx)],
                "torch": _torch_settings(),
                "kinds": {k: str(v) for k, v in batch.kinds.items()},
                "meta": batch.meta, "batch": rollout_sha256(batch)}
        h.update(_dumps(head).encode())
        _hash_module(h, ctx.model)
    except Exception:  # noqa: BLE001 - e.g. a nested tensor, an undigestable hook: compute it
        return None      # (a None key on any rank makes every rank compute)
    return h.digest()


def _torch_settings() -> list:
    """Process-wide settings a CPU forward's bits depend on."""
    return [torch.get_num_threads(), str(torch.get_default_dtype()),
            torch.are_deterministic_algorithms_enabled(), torch.is_autocast_enabled("cpu"),
            str(torch.get_autocast_dtype("cpu")), torch.get_float32_matmul_precision(),
            str(getattr(getattr(torch.backends.mkldnn, "matmul", None), "fp32_precision", "")),
            sdp.flash_sdp_enabled(), sdp.mem_efficient_sdp_enabled(), sdp.math_sdp_enabled(),
            sdp.cudnn_sdp_enabled(), bool(torch.backends.mkldnn.enabled)]


def _plain_attrs(obj) -> dict:
    out = {}
    for name, value in sorted(vars(obj).items()):
        if isinstance(value, _PLAIN):
            out[name] = value
        elif isinstance(value, (tuple, list)) and all(isinstance(v, _PLAIN) for v in value):
            out[name] = list(value)
        elif isinstance(value, (torch.device, torch.dtype)):
            out[name] = str(value)
    return out


def _hash_module(h, model: torch.nn.Module) -> None:
    configs: dict[int, str] = {}  # id -> digest of the config's contents (shared objects)
    tree = {id(m) for m in model.modules()}
    tensors: dict[str, torch.Tensor] = {}  # every module's, hashed in one stream at the end
    modules = []
    for name, module in model.named_modules(remove_duplicate=False):
        attrs = {k: v for k, v in _plain_attrs(module).items() if k not in _SET_BY_EVERY_PASS}
        own = dict([*module.named_parameters(recurse=False),
                    *module.named_buffers(recurse=False)])
        for attr, value in sorted(vars(module).items()):
            if _is_config(value):
                if id(value) not in configs:
                    configs[id(value)] = _config_digest(value, tree)
                attrs[attr] = configs[id(value)]
            elif isinstance(value, torch.Tensor):  # not a buffer (megatron's rotary inv_freq)
                own[f"{attr} (attribute)"] = value
            elif callable(value) and not isinstance(value, (type, torch.nn.Module)):
                attrs[attr] = _callable_text(value, tree)  # e.g. exact.py's own forward
            elif isinstance(value, torch.ScriptObject):  # e.g. quantize_dynamic's packed weights
                raise ValueError(f"cannot digest {attr}: a {type(value).__qualname__}")
        hooks = [_callable_text(f, tree) for d in (module._forward_pre_hooks,
                                                   module._forward_hooks) for f in d.values()]
        placements = {n: repr(t.placements) for n, t in own.items() if _is_dtensor(t)}
        modules.append([name, type(module).__qualname__, attrs, hooks, placements, sorted(own)])
        tensors.update({json.dumps([name, n]): t for n, t in own.items()})

    glob = [_callable_text(f, tree) for d in (nn_module._global_forward_pre_hooks,
                                              nn_module._global_forward_hooks)
            for f in d.values()]
    h.update(_dumps([modules, glob], tree).encode())
    h.update(_tensors_digest(tensors).encode())


def _callable_text(f, tree: set[int], depth: int = 0) -> str:
    """What a hook or an instance's own method computes with: its qualified name, a partial's
    arguments, a closure's cells and defaults, a bound method's object (a module of the model is
    hashed with the model). ValueError when something in it cannot be digested (the pass is then
    computed, never memoised)."""
    if depth > 4:
        raise ValueError("callable nested too deeply to digest")
    if isinstance(f, functools.partial):
        return (f"partial({_callable_text(f.func, tree, depth + 1)}; "
                f"{_value_text(list(f.args), tree, depth)}; "
                f"{_value_text(dict(f.keywords), tree, depth)})")
    func = getattr(f, "__func__", f)
    parts = [_qualname(func)]
    owner = getattr(f, "__self__", None)
    if owner is not None and not isinstance(owner, types.ModuleType):
        parts.append(_value_text(owner, tree, depth) if isinstance(owner, torch.nn.Module)
                     else _object_text(owner))
    cells = getattr(func, "__closure__", None) or ()
    parts += [_value_text(c.cell_contents, tree, depth) for c in cells]
    parts.append(_value_text(list(getattr(func, "__defaults__", None) or ()), tree, depth))
    return "|".join(parts)


def _value_text(v, tree: frozenset | set = frozenset(), depth: int = 0) -> str:
    """A value a forward may read -- captured by a hook, held by a config -- digested by what it
    is, never by how it prints (a tensor prints rounded, an object its address, which a later
    object may reuse); ValueError for anything else (the pass is then computed)."""
    if isinstance(v, _PLAIN):
        return repr(v)
    if isinstance(v, (torch.dtype, torch.device)):
        return str(v)
    if isinstance(v, enum.Enum):
        return f"{type(v).__qualname__}.{v.name}={v.value!r}"
    if isinstance(v, torch.Tensor):
        return f"tensor:{getattr(v, 'placements', '')}:{_tensors_digest({'': v})}"
    if isinstance(v, torch.nn.Module):
        if id(v) not in tree:
            raise ValueError("a callable refers to a module outside the model")
        return f"module:{type(v).__qualname__}"
    if isinstance(v, (list, tuple)):
        return "[" + ",".join(_value_text(x, tree, depth) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ",".join(f"{k!r}:{_value_text(x, tree, depth)}"
                              for k, x in sorted(v.items(), key=lambda kv: repr(kv[0]))) + "}"
    if isinstance(v, type):  # megatron's module specs name classes: their code is the build's
        return f"class:{v.__module__}.{v.__qualname__}"
    if isinstance(v, dist.ProcessGroup):  # megatron's pg_collection: who a collective spans
        return f"ProcessGroup{dist.get_process_group_ranks(v)}:{dist.get_backend(v)}"
    if _is_config(v):
        return _config_digest(v, tree)
    if callable(v):
        return _callable_text(v, tree, depth + 1)
    raise ValueError(f"cannot digest a {type(v).__qualname__}")


def _dumps(obj, tree: frozenset | set = frozenset()) -> str:
    """JSON of ``obj`` with every value JSON cannot hold digested by :func:`_value_text`."""
    return json.dumps(obj, sort_keys=True, default=lambda v: _value_text(v, tree))


def _object_text(obj) -> str:
    """A bound method's object that is not a module (FSDP2's per-module state, whose hooks cast
    to its mixed-precision policy): its type and its dataclass-valued attributes (the policies).
    Not its plain attributes: there they are lazy-initialisation bookkeeping (FSDP sets
    ``_is_root`` in the first forward), which would keep a fresh model from matching one that
    has run a pass."""
    parts = [type(obj).__qualname__]
    for attr, value in sorted(vars(obj).items()) if hasattr(obj, "__dict__") else ():
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            parts.append(f"{attr}={_config_digest(value)}")
    return "|".join(parts)


def _is_config(v) -> bool:
    """An HF ``PretrainedConfig`` or a dataclass instance (megatron's, FSDP2's policies)."""
    return hasattr(v, "to_json_string") or (dataclasses.is_dataclass(v)
                                             and not isinstance(v, type))


def _config_digest(cfg, tree: frozenset | set = frozenset()) -> str:
    """A model config's contents: an HF ``PretrainedConfig``'s every attribute (private ones and
    nested configs included; its class fixes the rest), a dataclass config's fields (megatron's
    ``TransformerConfig``, FSDP2's policies) and other plain attributes."""
    if hasattr(cfg, "to_json_string"):  # (its own JSON deep-copies the config: ~4 ms a call)
        text = _dumps(vars(cfg), tree)
    else:
        fields = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}
        text = _dumps([fields, _plain_attrs(cfg)], tree)
    return hashlib.sha256(f"{type(cfg).__qualname__}|{text}".encode()).hexdigest()


def _qualname(f) -> str:
    f = getattr(f, "__func__", f)
    return f"{getattr(f, '__module__', '?')}.{getattr(f, '__qualname__', type(f).__qualname__)}"


def _is_dtensor(t) -> bool:
    return hasattr(t, "to_local")


def _tensors_digest(tensors: dict[str, torch.Tensor]) -> str:
    """The project's canonical tensor hash (names, dtypes, shapes, bytes) of this rank's part:
    a DTensor's local shard (its placements go in the key beside it; the agreed key covers the
    other ranks' shards). It refuses a quantized tensor (its bytes leave out scale and zero
    point): the pass is then computed."""
    return rollout_sha256({n: (t.to_local() if _is_dtensor(t) else t).detach()
                           for n, t in tensors.items()})
