"""The reference backend: the reference trainer's models in one process, one rank -- the caller's
(:meth:`ReferenceBackend.replay`) or a one-rank warm pool's (:meth:`ReferenceBackend.
replay_in_pool`, what the executors use beside multi-rank backends).

It is the oracle other backends are compared against. Its own independence comes from the tests
of rlaudit.algo against naive loops and hand-worked numbers, and from the invariants.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import importlib

import torch

from rlaudit.backends import memo
from rlaudit.backends.base import ReplayRequest, Variant, VariantRun
from rlaudit.backends.launch.pool import run_ranks
from rlaudit.backends.replay import replay_variant
from rlaudit.errors import InputError, RankFailure
from rlaudit.model.critic import ValueModel
from rlaudit.model.load import load_model, load_tokenizer
from rlaudit.update import forward_memo
from rlaudit.update.context import TorchContext, build_optimizer
from rlaudit.update.step import Roles, needs_ref

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}

#: Requests with fewer variants than this compute every forward-only pass here. In one process a
#: pass costs about twice its memo key (qwen2-tiny, float64: ~12 vs ~5.5 ms, cProfile), so the
#: memo pays when more than about half the passes repeat -- as across a scenario's variants
#: (kl_k1: 31 of 47), not within the one or two variants of a target's or fuzzer's request (58
#: repeats in 544 passes of the toy trainer's run-level fuzz: the keys cost 3.3 of its 51 s).
#: The multi-rank backends always memoise: there a pass also waits on its collectives.
FORWARD_MEMO_MIN_VARIANTS = 3


@functools.lru_cache(maxsize=4)
def _cached_model(model_path: str, dtype: str, device: str):
    return load_model(model_path, dtype=DTYPES[dtype], device=device)


def _load_cached(model_path: str, dtype: str, device: str):
    """A fresh copy of the snapshot's model (loading once per process: variants reuse it)."""
    return copy.deepcopy(_cached_model(model_path, dtype, device))


@functools.lru_cache(maxsize=4)
def pad_id(model_path: str) -> int:
    return int(load_tokenizer(model_path).pad_token_id or 0)


def torch_roles(model_path: str, variant: Variant, *, dtype: str, device: str,
                wrap=lambda module: module, distributed: bool = False, group=None,
                ref_model_path: str | None = None) -> Roles:
    """Actor (+ reference, + critic for GAE) TorchContexts from a snapshot. ``wrap`` shards a
    module (FSDP2) or returns it unchanged (reference)."""
    cfg = variant.config
    dev = torch.device(device)
    pad = pad_id(model_path)
    base = _cached_model(model_path, dtype, device)  # every role below is a copy of it
    actor_model = wrap(copy.deepcopy(base))
    actor = TorchContext(actor_model, build_optimizer(actor_model.parameters(), cfg.actor.optim),
                         device=dev, distributed=distributed, group=group, pad_id=pad)
    ref = None
    if needs_ref(cfg):
        ref_model = (copy.deepcopy(base) if ref_model_path is None else
                     _load_cached(ref_model_path, dtype, device)).eval()
        for p in ref_model.parameters():
            p.requires_grad_(False)
        ref = TorchContext(wrap(ref_model), None, device=dev, distributed=distributed, group=group,
                           pad_id=pad)
    critic = None
    if cfg.use_critic:
        critic_model = wrap(ValueModel(copy.deepcopy(base), seed=cfg.trainer.seed))
        critic = TorchContext(critic_model, build_optimizer(critic_model.parameters(),
                                                            cfg.critic.optim),
                              device=dev, distributed=distributed, group=group, pad_id=pad)
    return Roles(actor=actor, ref=ref, critic=critic)


class ReferenceBackend:
    name = "reference"

    def available(self) -> tuple[bool, str]:
        return True, ""

    def replay(self, request: ReplayRequest) -> dict[str, VariantRun]:
        out = {}
        wrap = (functools.partial(perturb_weights, rel=request.weight_noise,
                                  draw=request.noise_draw)
                if request.weight_noise else (lambda module: module))
        enabled = request.forward_memo and len(request.variants) >= FORWARD_MEMO_MIN_VARIANTS
        with forward_memo.scope(request.device, enabled):
            for variant in request.variants:
                if request.weight_noise:
                    variant = perturb_scores(variant, rel=min(request.weight_noise,
                                                              SCORE_ROUNDOFF),
                                             draw=request.noise_draw)
                k = memo.key(request, variant)
                run = memo.lookup(k)
                if run is None:
                    torch.manual_seed(variant.config.trainer.seed)
                    run = replay_variant(
                        lambda v: torch_roles(request.model, v, dtype=request.dtype,
                                              device=request.device,
                                              ref_model_path=request.ref_model, wrap=wrap),
                        variant)
                    memo.store(k, run)
                run.name = variant.name
                out[variant.name] = run
        return out

    def replay_in_pool(self, request: ReplayRequest, *, threads: int) -> dict[str, VariantRun]:
        """:meth:`replay` in a one-rank group (the warm pool :data:`POOL` of the enclosing
        ``warm_pools`` block -- local ranks or Ray's --; a one-shot group outside one), with
        ``threads`` intra-op threads as in-process: the same results, bit for bit. What the
        executors do (rlaudit/executors). A rank that raised an :class:`InputError` raises it
        here too, as :meth:`replay` would have; any other failure is the group's
        :class:`~rlaudit.errors.RankFailure`."""
        try:
            return run_ranks(replay_in_rank, 1, pool=POOL, args=(request, threads),
                             device=request.device, timeout=request.timeout,
                             threads_per_rank=threads)[0]
        except RankFailure as exc:
            bad_input = _input_error(exc)
            if bad_input is None:
                raise
            raise bad_input from exc


#: the name of the warm pool the reference replays in, out of process
POOL = "reference"


def replay_in_rank(info, request: ReplayRequest, threads: int) -> dict[str, VariantRun]:
    """The reference backend's replay inside a one-rank group (:meth:`ReferenceBackend.
    replay_in_pool`), with ``threads`` intra-op threads as it would have in-process."""
    torch.set_num_threads(threads)
    return ReferenceBackend().replay(request)


def _input_error(failure) -> InputError | None:
    """The :class:`InputError` the one rank of a failed group raised while replaying (its message
    as it was), else None."""
    outcomes = getattr(failure, "outcomes", None) or ()
    if len(outcomes) != 1 or outcomes[0].kind != "raised" or outcomes[0].phase != "fn":
        return None
    module, _, name = (outcomes[0].exc_type or "").rpartition(".")
    try:
        raised = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError):
        return None
    if not (isinstance(raised, type) and issubclass(raised, InputError)):
        return None
    return InputError(outcomes[0].message or "")


#: seeds of the weight and score perturbations' first draw (fixed: the noise floor is
#: reproducible); draw k uses seed + k
NOISE_SEED = 0
SCORE_NOISE_SEED = 1_000_003
#: the scores' perturbation is at most float32's unit roundoff: rollouts store scores in float32,
#: and trainers whose model math is bf16 keep scores and advantages in float32 (verl, TRL)
SCORE_ROUNDOFF = 2.0 ** -24


def perturb_scores(variant: Variant, *, rel: float, draw: int = 0) -> Variant:
    """``variant`` with its rollout's ``scores`` rounded as a trainer at unit roundoff ``rel``
    rounds them: each distinct value ``s`` becomes ``s * (1 + rel * N(0, 1))``, one fixed draw
    per value, so equal scores stay equal (a group whose scores all agree keeps advantage 0, as
    it does at any precision) and unequal ones move apart by what rounding moves them.

    What weight noise alone misses: scores do not pass through the model, yet a standardised
    advantage ``(s - mean) / (std + eps)`` carries their rounding amplified by ``|s| / std``, and
    AdamW turns an advantage that should be ~0 but is 1e-7 at one precision and 0 at another into
    a step of a sizeable fraction of the learning rate on every weight only that row's tokens
    reach (measured: a float32 trainer's GRPO advantages on ``short-dapo`` (scores k/12 held in
    float32, group means not representable) moved the tied embedding of such tokens by lr/2)."""
    scores = variant.batch.tensors.get("scores")
    if scores is None or not scores.is_floating_point() or scores.numel() == 0:
        return variant
    values, which = torch.unique(scores, return_inverse=True)
    g = torch.Generator().manual_seed(SCORE_NOISE_SEED + draw)
    noise = torch.randn(values.shape, generator=g, dtype=torch.float64)
    moved = values.double() * (1 + rel * noise)   # float64: a float32 score would round back
    return dataclasses.replace(variant, batch=variant.batch.with_fields(scores=moved[which]))


def perturb_weights(module: torch.nn.Module, *, rel: float, draw: int = 0) -> torch.nn.Module:
    """Multiply every parameter by ``1 + rel * N(0, 1)`` (fixed draw number ``draw`` per
    parameter, in the module's parameter order): the effect of rounding at a precision whose
    unit roundoff is ``rel``, propagated through the whole step."""
    g = torch.Generator().manual_seed(NOISE_SEED + draw)
    with torch.no_grad():
        for p in module.parameters():
            noise = torch.randn(p.shape, generator=g, dtype=torch.float64)
            p.mul_((1 + rel * noise).to(p.dtype))
    return module
