"""verl >= 0.9's Megatron engine on megatron-core without Transformer Engine (CPU, gloo; or CUDA):
the two construction steps verl's CPU-less state forces, and nothing else. Imports verl, mbridge
and megatron-core at module level: imported only inside a verl rank, after the platform is
selected (rlaudit.targets.peers.verl_cpu.select).

What stands in, each for the call of verl / mbridge that cannot run here (verl 0.9.1,
mbridge 0.15.1):

1. **The transformer layer spec.** verl builds the model through mbridge (vanilla_mbridge:
   workers/engine/megatron/transformer_impl.py:331, ``AutoBridge.from_config``), whose
   provider asks megatron-core for the Transformer Engine spec unconditionally
   (mbridge/core/llm_bridge.py:149-151, ``use_transformer_engine=True``: ``NameError: TENorm``
   without TE). :class:`LocalSpecBridge` is the same bridge with megatron-core's local spec
   (``use_transformer_engine=False``), whose core attention is :class:`PackedDotProductAttention`
   (megatron's own ``DotProductAttention`` refuses verl's packed ``thd`` micro-batches,
   dot_product_attention.py:153: it runs each packed segment alone, causal, through it). The
   local spec keeps the two RMSNorms as modules of their own where TE fuses them into the
   following linear layer, so mbridge's name map gets their two names (the same HF tensors).
   mbridge's provider (its GPTModel arguments, vocabulary padding) and its HF weight loading run
   as shipped.
2. **The device move.** mbridge's ``get_model`` moves every chunk with ``.cuda()``
   (mbridge/core/util.py:151) before wrapping it in megatron-core's DDP. :meth:`LocalSpecBridge.
   get_model` calls mbridge's ``get_model`` on the one branch that skips that line
   (``use_torch_fsdp2`` with ``use_cpu_initialization``, unwrapped: the FSDP2 flag selects
   nothing else without DDP), moves the chunks to the rank's device itself, then wraps them in
   megatron-core's ``DistributedDataParallel`` with the config mbridge would build
   (util.py:165-242: its defaults updated by verl's ``ddp_config``, no buckets without overlap,
   parameters broadcast over data parallel).

:class:`MegatronEngineCPU` is verl's ``MegatronEngineWithLMHead`` with only ``_build_tf_config``
extended: the bridge verl built there continues as a :class:`LocalSpecBridge` of the same class
(its state carried over; the mixin has none), and, without CUDA, megatron's RNG tracker is
seeded (3: verl seeds it only with a device, workers/engine/megatron/utils.py:35; megatron's
attention forks it). The engine's forward_backward_batch, forward_step, logits processor, loss,
optimizer and scheduler are verl's. megatron-core's own CUDA assumptions (DDP buffers, schedules, optimizer scalars) are
rlaudit's Megatron backend's CPU views (rlaudit.backends.megatron.compat), applied only without
CUDA.
"""

from __future__ import annotations

import torch
from mbridge.core.util import unwrap_model
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.utils import get_model_config
from verl.workers.engine.base import EngineRegistry
from verl.workers.engine.megatron.transformer_impl import MegatronEngineWithLMHead

from rlaudit.backends.megatron.model import attention_mask_4d

#: the local spec's own RMSNorm parameters -> the HF tensors mbridge maps TE's fused
#: ``layer_norm_weight`` to (mbridge/models/qwen2.py:27-29,52-54)
LOCAL_NORMS = {"input_layernorm.weight": ["model.layers.{layer_number}.input_layernorm.weight"],
               "pre_mlp_layernorm.weight":
                   ["model.layers.{layer_number}.post_attention_layernorm.weight"]}


class PackedDotProductAttention(DotProductAttention):
    """megatron-core's local core attention over verl's packed ``thd`` micro-batch: each segment
    of ``packed_seq_params.cu_seqlens_q_padded`` (verl pads each sequence inside the pack,
    models/mcore/util.py:380) alone, causal, as Transformer Engine's packed attention computes
    it. query ``[t, heads, dim]``, key / value ``[t, groups, dim]``; returns ``[t, 1,
    heads * dim]``."""

    def forward(self, query, key, value, attention_mask, attn_mask_type=None,
                attention_bias=None, packed_seq_params=None):
        if packed_seq_params is None:
            return super().forward(query, key, value, attention_mask,
                                   attn_mask_type=attn_mask_type, attention_bias=attention_bias)
        cu = packed_seq_params.cu_seqlens_q_padded
        if cu is None:
            cu = packed_seq_params.cu_seqlens_q
        bounds = [int(x) for x in cu.tolist()]
        outs = []
        for lo, hi in zip(bounds[:-1], bounds[1:]):
            if hi == lo:
                continue
            mask = attention_mask_4d(torch.ones(1, hi - lo, dtype=torch.bool,
                                                device=query.device))
            outs.append(super().forward(query[lo:hi].unsqueeze(1), key[lo:hi].unsqueeze(1),
                                        value[lo:hi].unsqueeze(1), mask,
                                        attn_mask_type=attn_mask_type))
        return torch.cat(outs, dim=0)


class LocalSpecBridge:
    """Mixed in before an mbridge bridge class (:func:`local_spec_class`): the local layer spec
    and the device move (module docstring, 1 and 2)."""

    def _get_transformer_layer_spec(self, vp_stage=None):
        extra = {"vp_stage": vp_stage} if vp_stage is not None else {}
        spec = get_gpt_decoder_block_spec(self.config, use_transformer_engine=False, **extra)
        for layer in spec.layer_specs:
            layer.submodules.self_attention.submodules.core_attention = PackedDotProductAttention
        return spec

    def _weight_name_mapping_mcore_to_hf(self, name: str) -> list[str]:
        for suffix, hf in LOCAL_NORMS.items():
            if name.startswith("decoder.layers.") and name.endswith("." + suffix):
                return [x.format(layer_number=name.split(".")[2]) for x in hf]
        return super()._weight_name_mapping_mcore_to_hf(name)

    def get_model(self, *, wrap_with_ddp: bool = False, ddp_config: dict | None = None,
                  **kwargs):
        models = super().get_model(wrap_with_ddp=False, use_torch_fsdp2=True,
                                   use_cpu_initialization=True, **kwargs)
        device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
        models = [m.to(device) for m in models]
        if not wrap_with_ddp:
            return models
        options = {"grad_reduce_in_fp32": True, "use_distributed_optimizer": True,
                   **(ddp_config or {})}
        config = DistributedDataParallelConfig(**options)
        if not config.overlap_grad_reduce:
            config.bucket_size = None
        wrapped = [DistributedDataParallel(config=get_model_config(m), ddp_config=config,
                                           module=m, disable_bucketing=i > 0)
                   for i, m in enumerate(models)]
        for m in wrapped:
            m.broadcast_params()
        return wrapped


_classes: dict[type, type] = {}


def local_spec_class(bridge_cls: type) -> type:
    """``bridge_cls`` with :class:`LocalSpecBridge` first in its MRO (one class per bridge)."""
    if bridge_cls not in _classes:
        _classes[bridge_cls] = type(f"LocalSpec{bridge_cls.__name__}",
                                    (LocalSpecBridge, bridge_cls), {})
    return _classes[bridge_cls]


class MegatronEngineCPU(MegatronEngineWithLMHead):
    """verl's Megatron LM engine, its mbridge bridge built by verl and then given the local spec
    and device move (module docstring); everything else verl's."""

    def _build_tf_config(self):
        if not torch.cuda.is_available():
            # verl seeds megatron's RNG tracker only with a device (set_random_seed,
            # workers/engine/megatron/utils.py:35); megatron's attention forks it (dropout)
            model_parallel_cuda_manual_seed(self.engine_config.seed)
        super()._build_tf_config()
        if not self.engine_config.vanilla_mbridge:
            raise NotImplementedError("the Megatron engine runs here through mbridge only "
                                      "(megatron.vanilla_mbridge: true; Megatron-Bridge is "
                                      "not installed)")
        local = object.__new__(local_spec_class(type(self.bridge)))
        local.__dict__.update(vars(self.bridge))
        self.bridge = local


_registered: set[str] = set()


def register(device: str, cls: type | None = None) -> None:
    """``cls`` (:class:`MegatronEngineCPU` or a subclass) for ``(language_model, megatron,
    device)``, once per process.
    ``device`` is a key of rlaudit's own, which the rank selects with verl's
    ``VERL_ENGINE_DEVICE`` (workers/engine/base.py:405-406) on CPU and CUDA alike, so the column
    runs the same engine on both (verl registers its own for cuda / npu,
    transformer_impl.py:1171)."""
    if device not in _registered:
        EngineRegistry.register(model_type="language_model", backend="megatron",
                                device=device)(cls or MegatronEngineCPU)
        _registered.add(device)


def master_pairs(optimizer) -> list[tuple[torch.nn.Parameter, torch.Tensor]]:
    """(model parameter, its float32 main copy) for each bf16 / fp16 parameter megatron-core's
    mixed-precision optimizer keeps one for (``float16_groups`` / ``fp32_from_float16_groups``,
    megatron/core/optimizer/optimizer.py:657-658), through a ChainedOptimizer."""
    out = []
    for opt in getattr(optimizer, "chained_optimizers", None) or [optimizer]:
        for low, main in zip(getattr(opt, "float16_groups", ()),
                             getattr(opt, "fp32_from_float16_groups", ())):
            out += list(zip(low, main))
    return out


class MainWeights:
    """A model chunk as mbridge's ``export_weights`` reads it (its ``named_parameters``, and its
    ``decoder`` and ``state_dict`` keys for the layer numbering), each parameter shown as the
    optimizer's float32 main copy: the live parameters are never touched (re-pointing one's
    ``.data`` at another dtype drops the gradient hooks megatron-core's DDP put on it)."""

    def __init__(self, live, main: dict[int, torch.Tensor]):
        self.live, self.main = live, main

    def __getattr__(self, name):
        return getattr(self.live, name)

    def named_parameters(self, *args, **kwargs):
        for name, p in self.live.named_parameters(*args, **kwargs):
            yield name, self.main.get(id(p), p).detach().float()


def hf_params(engine, *, main: bool = False) -> dict[str, torch.Tensor]:
    """The engine's parameters by Hugging Face name, float32 on the CPU, through mbridge's own
    export (``export_weights``: the inverse of its loading): the bf16 parameters the model
    computes with (what verl exports to its rollout), or with ``main`` the optimizer's float32
    main copies (:class:`MainWeights`), the state training continues from. Both start from the
    snapshot rounded to bf16 (mbridge loads it into the bf16 model; megatron-core's optimizer
    copies its main weights from there), so ``main`` minus the rounded snapshot is the update
    exactly."""
    table = {id(p): m for p, m in master_pairs(engine.optimizer)} if main else {}
    chunks = [MainWeights(unwrap_model(chunk), table) for chunk in engine.module]
    return {name: t.detach().to(torch.bfloat16 if not main else torch.float32).cpu().clone()
            for name, t in engine.bridge.export_weights(chunks)}


__all__ = ["LOCAL_NORMS", "LocalSpecBridge", "MainWeights", "MegatronEngineCPU", "PackedDotProductAttention",
           "hf_params", "local_spec_class", "master_pairs", "register"]
