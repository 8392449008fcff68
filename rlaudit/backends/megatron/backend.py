"""The Megatron backend: the HF snapshot converted to a megatron-core GPTModel split over
TP x PP x DP ranks, replaying every variant inside one spawned group.

The update step is rlaudit's shared one (rlaudit/update); this module only builds the models and
wraps them in :class:`~rlaudit.backends.megatron.context.MegatronContext` (see there for how the
gradient scale, metrics and the optimizer step go through megatron's machinery). It mirrors
rlaudit/backends/fsdp.py.

Layout: ``{"tp": T, "pp": P, "dp": D}`` (each default 1; world size ``T * P * D``; megatron's rank
order, TP ranks adjacent). Device: CPU/gloo here (with rlaudit's CPU patches), CUDA/NCCL on GPU
machines (same code). dtype: float32/float64 parameters; bfloat16 (megatron's Float16 optimizer with
float32 main weights) is meant for GPUs.

Roles per variant: the actor (megatron DDP + megatron optimizer: ``actor.optim`` adamw -> megatron
"adam" in decoupled (AdamW) mode, sgd -> "sgd" with momentum 0; weight decay on every parameter, as
the reference's torch optimizers do; the DistributedOptimizer for adamw unless float64, which it
does not accept) and, when KL is used, the reference policy (a bare GPTModel stage in eval mode).
A critic (``adv_estimator: gae``) is not implemented: such variants come back with
``info["unsupported"]`` and no steps, and the invariants report n/a for them.

What comes back per variant: the VariantRun of global rank 0 (metrics are identical on every rank;
per-token outputs are broadcast from the last pipeline stage; parameters are gathered over the
model-parallel group), with ``micro_log`` holding every rank's micro-batches and ``info``:
``layout``, ``optimizer`` (megatron's optimizer class), ``norm_log`` (per optimizer step, the
norm used and megatron's own float32 norm), ``rank_metrics_agree`` (every rank logged the same
metrics) and ``rank_params_differ`` (initially and after each step, the ranks whose gathered full parameters
differ from global rank 0's: every rank gathers the whole model over its model-parallel group,
so data-parallel replicas must hold the same bits; empty when they all do).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist

from rlaudit.backends import faults
from rlaudit.backends.base import ReplayRequest, Variant, VariantRun
from rlaudit.backends.launch.pool import run_ranks
from rlaudit.backends.megatron import compat
from rlaudit.backends.megatron.context import (CONFIG_OVERRIDES, MegatronContext,
                                               finalize_grads_without_token_scaling)
from rlaudit.backends.megatron.convert import load_hf_checkpoint, load_hf_weights
from rlaudit.backends.megatron.model import (build_gpt_model, check_layout,
                                             freeze_padding_embedding, hf_model_spec)
from rlaudit.backends.replay import replay_variant
from rlaudit.data.io import rollout_sha256
from rlaudit.errors import InputError
from rlaudit.model.load import load_tokenizer
from rlaudit.update import forward_memo
from rlaudit.update.step import Roles, needs_ref

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}
LAYOUT_KEYS = ("tp", "pp", "dp")
UNSUPPORTED_CRITIC = "critic (GAE) is not implemented on the megatron backend"
#: seeds megatron's RNG tracker; nothing random runs after the weights are loaded (dropout is 0)
MEGATRON_SEED = 1234
_SOURCE = "megatron layout"


def parse_layout(layout: dict) -> tuple[int, int, int]:
    """``(tp, pp, dp)`` from a layout mapping; InputError for unknown keys or bad sizes."""
    for key in layout:
        if key not in LAYOUT_KEYS:
            raise InputError(f"unknown layout key; valid: {', '.join(LAYOUT_KEYS)}",
                             source=_SOURCE, key=key)
    sizes = []
    for key in LAYOUT_KEYS:
        value = layout.get(key, 1)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise InputError(f"expected an integer >= 1, got {value!r}", source=_SOURCE, key=key)
        sizes.append(value)
    return tuple(sizes)


def check_request(request: ReplayRequest) -> tuple[int, int, int]:
    """Validate layout, dtype and the snapshots' split before any rank is spawned."""
    tp, pp, dp = parse_layout(request.layout)
    if request.dtype not in DTYPES:
        raise InputError(f"expected one of {list(DTYPES)}, got {request.dtype!r}", key="dtype")
    for path in {request.model, request.ref_model or request.model}:
        config_file = Path(path) / "config.json"
        if not config_file.is_file():
            raise InputError("not an HF model folder: config.json not found", source=str(path))
        spec = hf_model_spec(json.loads(config_file.read_text()))
        check_layout(spec, tp=tp, pp=pp)
    return tp, pp, dp


# ---- inside a rank ------------------------------------------------------------------------------

def _actor_context(checkpoint, variant: Variant, *, dtype, device, pad_id):
    """Actor: GPTModel stage -> megatron DDP -> megatron optimizer, in a MegatronContext."""
    # lazy: megatron-core: optional, 4 s import
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer  # lazy: as above

    hf_config, hf_sd = checkpoint
    optim = variant.config.actor.optim
    dist_opt = optim.name == "adamw" and dtype != torch.float64  # float64: not accepted by it
    model = build_gpt_model(hf_config, dtype=dtype, overrides=CONFIG_OVERRIDES).to(device)
    load_hf_weights(model, hf_sd, hf_config)
    freeze_padding_embedding(model, hf_config)  # HF's padding_idx semantics (the reference's)
    ddp_cfg = DistributedDataParallelConfig(grad_reduce_in_fp32=dtype == torch.bfloat16,
                                            overlap_grad_reduce=False,
                                            use_distributed_optimizer=dist_opt)
    ddp = DistributedDataParallel(model.config, ddp_cfg, model)
    model.config.finalize_model_grads_func = finalize_grads_without_token_scaling
    opt_cfg = OptimizerConfig(
        optimizer="adam" if optim.name == "adamw" else "sgd", lr=optim.lr, min_lr=optim.lr,
        weight_decay=optim.weight_decay, adam_beta1=optim.betas[0], adam_beta2=optim.betas[1],
        adam_eps=optim.eps, decoupled_weight_decay=True, sgd_momentum=0.0,
        clip_grad=variant.config.actor.grad_clip, bf16=dtype == torch.bfloat16, fp16=False,
        params_dtype=dtype, use_distributed_optimizer=dist_opt)
    # config_overrides={}: no per-parameter groups (megatron's default exempts biases and norms
    # from weight decay; the reference decays every parameter)
    optimizer = get_megatron_optimizer(opt_cfg, [ddp], config_overrides={})
    ddp.train()
    return MegatronContext(ddp, hf_config, optimizer, device=device, pad_id=pad_id)


def _ref_context(checkpoint, *, dtype, device, pad_id):
    """Reference policy: a bare GPTModel stage in eval mode, no gradients (forward-only)."""
    hf_config, hf_sd = checkpoint
    model = build_gpt_model(hf_config, dtype=dtype, overrides=CONFIG_OVERRIDES).to(device)
    load_hf_weights(model, hf_sd, hf_config)
    model.eval().requires_grad_(False)
    return MegatronContext(model, hf_config, None, device=device, pad_id=pad_id)


def replay_in_rank(info, request: ReplayRequest) -> dict[str, VariantRun]:
    """Every rank: set up megatron for the layout, replay each variant, tear down.

    Global rank 0 returns full VariantRuns; other ranks only what :func:`merge_ranks` reads
    (metrics, micro-batch logs), so results stay small."""
    tp, pp, dp = parse_layout(request.layout)
    if info.world_size != tp * pp * dp:
        raise InputError(f"{info.world_size} ranks cannot hold tp*pp*dp = {tp * pp * dp}",
                         source=_SOURCE)
    dtype = DTYPES[request.dtype]
    compat.init_megatron(tp=tp, pp=pp, seed=MEGATRON_SEED)
    try:
        actor_ckpt = load_hf_checkpoint(request.model)
        ref_ckpt = load_hf_checkpoint(request.ref_model) if request.ref_model else actor_ckpt
        pad_id = int(load_tokenizer(request.model).pad_token_id or 0)
        kw = dict(dtype=dtype, device=info.device, pad_id=pad_id)
        out = {}
        with forward_memo.scope(info.device, request.forward_memo):
            for variant in request.variants:
                if variant.config.use_critic:
                    out[variant.name] = VariantRun(name=variant.name,
                                                   info={"unsupported": UNSUPPORTED_CRITIC})
                    continue
                torch.manual_seed(variant.config.trainer.seed)
                made = []

                def make_roles(v: Variant) -> Roles:
                    ref = _ref_context(ref_ckpt, **kw) if needs_ref(v.config) else None
                    made.append(_actor_context(actor_ckpt, v, **kw))
                    return Roles(actor=made[-1], ref=ref)

                if request.faults:  # test-only (rlaudit/backends/faults.py)
                    variant, make_roles = faults.inject(request.faults, "megatron", variant,
                                                        make_roles)
                run = replay_variant(make_roles, variant)
                run.info["norm_log"] = list(made[0].norm_log)
                run.info["optimizer"] = "+".join(type(o).__name__
                                                 for o in made[0].inner_optimizers())
                # what every rank holds, initially and after each step (merge_ranks compares them)
                held = {} if run.params_initial is None else {"initial": run.params_initial}
                held.update({f"after step {k}": p for k, p in enumerate(run.params)})
                run.info["params_sha"] = {when: rollout_sha256({"params": p})
                                          for when, p in held.items()}
                if info.rank != 0:  # keep what merge_ranks reads
                    run = VariantRun(name=run.name, steps=run.steps, micro_log=run.micro_log,
                                     info=run.info)
                out[variant.name] = run
        return out
    finally:
        compat.teardown_megatron()


def merge_ranks(per_rank: list[dict[str, VariantRun]], layout: tuple[int, int, int]
                ) -> dict[str, VariantRun]:
    """Rank 0's runs with every rank's micro-batch log (rank order) and the layout in ``info``."""
    tp, pp, dp = layout
    runs = per_rank[0]
    for name, run in runs.items():
        run.info["layout"] = {"tp": tp, "pp": pp, "dp": dp}
        if run.info.get("unsupported"):
            continue
        run.micro_log = [[r[name].micro_log[step][0] for r in per_rank]
                         for step in range(len(run.micro_log))]
        run.info["rank_metrics_agree"] = all(
            _metrics(r[name].steps) == _metrics(run.steps) for r in per_rank)
        differ = {}
        for when, sha in run.info.get("params_sha", {}).items():
            ranks = [k for k, r in enumerate(per_rank) if r[name].info["params_sha"].get(when) != sha]
            if ranks:
                differ[when] = ranks
        run.info["rank_params_differ"] = differ
    return runs


def _metrics(steps: list[dict[str, float]]) -> list[dict[str, float]]:
    """Metrics without timings (which legitimately differ between ranks)."""
    return [{k: v for k, v in s.items() if not k.startswith("timing/")} for s in steps]


class MegatronBackend:
    name = "megatron"

    def available(self) -> tuple[bool, str]:
        try:
            compat.check_version()
        except InputError as e:
            return False, str(e)
        if not dist.is_available():
            return False, "torch.distributed is not available"
        return True, ""

    def rank_pool(self, layout: dict) -> tuple[str, int]:
        """The warm pool a replay with ``layout`` runs in: (pool name, world size). One pool per
        world size serves every layout of that size: replay_in_rank builds (and tears down) the
        layout's parallel_state per request."""
        tp, pp, dp = parse_layout(layout)
        return "megatron", tp * pp * dp

    def replay(self, request: ReplayRequest) -> dict[str, VariantRun]:
        layout = check_request(request)
        pool, world = self.rank_pool(request.layout)
        per_rank = run_ranks(replay_in_rank, world, pool=pool, args=(request,),
                             device=request.device, timeout=request.timeout)
        return merge_ranks(per_rank, layout)


__all__ = ["MegatronBackend", "merge_ranks", "parse_layout", "replay_in_rank"]
