"""HF Qwen2/Llama state dict <-> megatron-core GPTModel (local spec) state dicts, for any TP x PP.

    hf_config, hf_sd = load_hf_checkpoint("path/to/hf_folder")
    sd = hf_to_megatron(hf_sd, hf_config, tp_rank=r, tp_size=2, pp_rank=0, pp_size=1)
    load_hf_weights(model, hf_sd, hf_config)        # the same, for this rank, strict load
    hf_sd2 = gather_hf_state_dict(model, hf_config)  # all ranks' shards -> full HF names

Layouts (per layer ``i``; megatron names are local to the stage, HF names global):

==================================  ================================  =============================
megatron ``decoder.layers.i.``      HF ``model.layers.(i+off).``       split over TP
==================================  ================================  =============================
input_layernorm.weight              input_layernorm.weight            replicated
self_attention.linear_qkv.weight    q_proj, k_proj, v_proj (.weight)  dim 0, whole query groups
self_attention.linear_qkv.bias      q/k/v_proj.bias (Qwen2)           dim 0, whole query groups
self_attention.linear_proj.weight   self_attn.o_proj.weight           dim 1 (row parallel)
pre_mlp_layernorm.weight            post_attention_layernorm.weight   replicated
mlp.linear_fc1.weight               gate_proj, up_proj                [gate_shard; up_shard]
mlp.linear_fc2.weight               mlp.down_proj.weight              dim 1 (row parallel)
==================================  ================================  =============================

plus ``embedding.word_embeddings.weight`` (first stage; ``model.embed_tokens``), and on the last
stage ``decoder.final_layernorm.weight`` (``model.norm``) and ``output_layer.weight``
(``lm_head``; absent when embeddings are tied). Both vocab matrices are split over TP along the
vocab after zero-padding to :func:`~rlaudit.backends.megatron.model.padded_vocab_size`.
``off = pp_rank * num_layers // pp_size``.

The fused QKV matrix is interleaved per query group: for group g (of ``nkv``) it holds the
``nq/nkv`` query heads of that group, then its key head, then its value head.

The same correspondence at module level (:func:`module_names`; the drift localisation hooks these
modules on both sides): ``embedding`` <-> ``model.embed_tokens``; per layer
``decoder.layers.i`` <-> ``model.layers.(i+off)`` and its ``input_layernorm``,
``self_attention`` <-> ``self_attn``, ``pre_mlp_layernorm`` <-> ``post_attention_layernorm``,
``mlp``; ``decoder.final_layernorm`` <-> ``model.norm``; ``output_layer`` <-> ``lm_head``.
Megatron's outputs are sequence-first (``[s, b, ...]``) and the output layer's are split over TP
along the (padded) vocabulary; every other module's output is whole on every TP rank.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping

import torch
import torch.distributed as dist

from rlaudit.backends.megatron.model import (HFModelSpec, check_layout, hf_model_spec,
                                             padded_vocab_size)
from rlaudit.errors import CheckFailed, InputError
from rlaudit.update.collectives import all_gather_tensor_dicts

EMBED = "embedding.word_embeddings.weight"
FINAL_NORM = "decoder.final_layernorm.weight"
OUTPUT = "output_layer.weight"
_NORMS = (("input_layernorm.weight", "input_layernorm.weight"),
          ("pre_mlp_layernorm.weight", "post_attention_layernorm.weight"))
#: megatron module of a decoder layer -> HF module (the parents of the parameters mapped below;
#: "" is the decoder layer itself)
_LAYER_MODULES = ((_NORMS[0][0].rsplit(".", 1)[0], _NORMS[0][1].rsplit(".", 1)[0]),
                  ("self_attention", "self_attn"),
                  (_NORMS[1][0].rsplit(".", 1)[0], _NORMS[1][1].rsplit(".", 1)[0]),
                  ("mlp", "mlp"), ("", ""))


# --------------------------------------------------------------------------- QKV layout

def interleave_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, num_heads: int,
                   num_kv_heads: int, head_dim: int) -> torch.Tensor:
    """HF q/k/v (weights ``[heads*hd, h]`` or biases ``[heads*hd]``) -> megatron's fused layout.

    Returns a new ``[nkv * (nq/nkv + 2) * hd, ...]`` tensor: per query group, its query heads,
    its key head, its value head.
    """
    r = num_heads // num_kv_heads
    tail = q.shape[1:]
    return torch.cat([q.reshape(num_kv_heads, r * head_dim, *tail),
                      k.reshape(num_kv_heads, head_dim, *tail),
                      v.reshape(num_kv_heads, head_dim, *tail)], dim=1
                     ).reshape(num_kv_heads * (r + 2) * head_dim, *tail)


def split_qkv(qkv: torch.Tensor, *, num_heads: int, num_kv_heads: int, head_dim: int
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of :func:`interleave_qkv` (on the full, TP-gathered fused tensor); new tensors."""
    r = num_heads // num_kv_heads
    tail = qkv.shape[1:]
    grouped = qkv.reshape(num_kv_heads, (r + 2) * head_dim, *tail)
    q, k, v = torch.split(grouped, [r * head_dim, head_dim, head_dim], dim=1)
    return (q.reshape(num_heads * head_dim, *tail).clone(),
            k.reshape(num_kv_heads * head_dim, *tail).clone(),
            v.reshape(num_kv_heads * head_dim, *tail).clone())


# --------------------------------------------------------------------------- helpers

def _shard(t: torch.Tensor, dim: int, rank: int, size: int) -> torch.Tensor:
    return torch.chunk(t, size, dim=dim)[rank].clone()


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    if t.shape[0] == rows:
        return t
    return torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])], dim=0)


def _need(hf_sd: Mapping[str, torch.Tensor], name: str) -> torch.Tensor:
    if name not in hf_sd:
        raise InputError("missing from the HF state dict", source="hf_state_dict", key=name)
    return hf_sd[name]


def _check_ranks(tp_rank: int, tp_size: int, pp_rank: int, pp_size: int) -> None:
    for name, rank, size in (("tp_rank", tp_rank, tp_size), ("pp_rank", pp_rank, pp_size)):
        if size < 1 or not 0 <= rank < size:
            raise InputError(f"expected 0 <= {name} < {size}, got {rank}", key=name)


def stage_layers(spec: HFModelSpec, pp_rank: int, pp_size: int) -> range:
    """Global indices of the decoder layers held by pipeline stage ``pp_rank`` (even split)."""
    per = spec.num_layers // pp_size
    return range(pp_rank * per, (pp_rank + 1) * per)


def module_names(hf_config: Any, *, pp_rank: int = 0, pp_size: int = 1) -> dict[str, str]:
    """Megatron module name (local to stage ``pp_rank``) -> HF module name, for every module of
    the stage whose parameters :func:`hf_to_megatron` maps, plus each decoder layer, in depth
    order (embedding, then per layer: input norm, attention, MLP norm, MLP, the layer; final
    norm, output layer)."""
    spec = hf_model_spec(hf_config)
    _check_ranks(0, 1, pp_rank, pp_size)
    out: dict[str, str] = {}
    if pp_rank == 0:
        out[EMBED.rsplit(".", 2)[0]] = "model.embed_tokens"
    for local, layer in enumerate(stage_layers(spec, pp_rank, pp_size)):
        for mg, hf in _LAYER_MODULES:
            out[f"decoder.layers.{local}" + (f".{mg}" if mg else "")] = (
                f"model.layers.{layer}" + (f".{hf}" if hf else ""))
    if pp_rank == pp_size - 1:
        out[FINAL_NORM.rsplit(".", 1)[0]] = "model.norm"
        out[OUTPUT.rsplit(".", 1)[0]] = "lm_head"
    return out


def module_names_of_stage(hf_config: Any) -> dict[str, str]:
    """:func:`module_names` of this rank's pipeline stage (from ``megatron.core.parallel_state``)."""
    from megatron.core import parallel_state as ps  # lazy: megatron-core: optional, 4 s import

    return module_names(hf_config, pp_rank=ps.get_pipeline_model_parallel_rank(),
                        pp_size=ps.get_pipeline_model_parallel_world_size())


# --------------------------------------------------------------------------- HF -> megatron

def hf_to_megatron(hf_sd: Mapping[str, torch.Tensor], hf_config: Any, *, tp_rank: int = 0,
                   tp_size: int = 1, pp_rank: int = 0, pp_size: int = 1) -> dict[str, torch.Tensor]:
    """The state dict of megatron rank (``tp_rank``, ``pp_rank``) for an HF state dict.

    Keys are the stage's local megatron names (no ``_extra_state``); values are new tensors in
    the HF dtype (the inputs are never aliased). Raises InputError for a missing HF key or an
    impossible split.
    """
    spec = hf_model_spec(hf_config)
    check_layout(spec, tp=tp_size, pp=pp_size)
    _check_ranks(tp_rank, tp_size, pp_rank, pp_size)
    nq, nkv, hd = spec.num_heads, spec.num_kv_heads, spec.head_dim
    vpad = padded_vocab_size(spec.vocab_size, tp_size)
    out: dict[str, torch.Tensor] = {}

    def vocab_shard(name: str) -> torch.Tensor:
        return _shard(_pad_rows(_need(hf_sd, name), vpad), 0, tp_rank, tp_size)

    if pp_rank == 0:
        out[EMBED] = vocab_shard("model.embed_tokens.weight")
    if pp_rank == pp_size - 1:
        out[FINAL_NORM] = _need(hf_sd, "model.norm.weight").clone()
        if not spec.tied_embeddings:
            out[OUTPUT] = vocab_shard("lm_head.weight")
    for local, layer in enumerate(stage_layers(spec, pp_rank, pp_size)):
        hf, mg = f"model.layers.{layer}.", f"decoder.layers.{local}."
        for mg_name, hf_name in _NORMS:
            out[mg + mg_name] = _need(hf_sd, hf + hf_name).clone()
        for kind in ("weight", "bias") if spec.qkv_bias else ("weight",):
            q, k, v = (_need(hf_sd, f"{hf}self_attn.{p}_proj.{kind}") for p in "qkv")
            fused = interleave_qkv(q, k, v, num_heads=nq, num_kv_heads=nkv, head_dim=hd)
            out[f"{mg}self_attention.linear_qkv.{kind}"] = _shard(fused, 0, tp_rank, tp_size)
        out[mg + "self_attention.linear_proj.weight"] = _shard(
            _need(hf_sd, hf + "self_attn.o_proj.weight"), 1, tp_rank, tp_size)
        gate = _shard(_need(hf_sd, hf + "mlp.gate_proj.weight"), 0, tp_rank, tp_size)
        up = _shard(_need(hf_sd, hf + "mlp.up_proj.weight"), 0, tp_rank, tp_size)
        out[mg + "mlp.linear_fc1.weight"] = torch.cat([gate, up], dim=0)
        out[mg + "mlp.linear_fc2.weight"] = _shard(
            _need(hf_sd, hf + "mlp.down_proj.weight"), 1, tp_rank, tp_size)
    return out


# --------------------------------------------------------------------------- megatron -> HF

def _replicated(shards: list[torch.Tensor], name: str) -> torch.Tensor:
    for r, t in enumerate(shards[1:], start=1):
        if not torch.equal(t, shards[0]):
            raise CheckFailed(f"{name}: TP-replicated parameter differs between tp ranks 0 and {r} "
                              f"(max abs diff {(t - shards[0]).abs().max().item():.3e})")
    return shards[0].clone()


def megatron_to_hf(shards: Mapping[tuple[int, int], Mapping[str, torch.Tensor]], hf_config: Any,
                   *, tp_size: int, pp_size: int) -> dict[str, torch.Tensor]:
    """Full HF state dict from every rank's megatron state dict.

    ``shards[(tp_rank, pp_rank)]``: that rank's local megatron state dict (``_extra_state`` keys
    are ignored). Returns new tensors under HF names, vocab padding removed; with tied embeddings
    there is no ``lm_head.weight`` (HF ties it to ``model.embed_tokens.weight``).
    Raises InputError if a rank or key is missing, and CheckFailed if a TP-replicated parameter
    (a norm weight) differs between TP ranks (replicas drifting apart mean a missing all-reduce).
    """
    spec = hf_model_spec(hf_config)
    check_layout(spec, tp=tp_size, pp=pp_size)
    nq, nkv, hd = spec.num_heads, spec.num_kv_heads, spec.head_dim
    tps = range(tp_size)
    for key in ((t, p) for t in tps for p in range(pp_size)):
        if key not in shards:
            raise InputError(f"no state dict for (tp_rank, pp_rank) = {key}", key="shards")

    def get(tp_rank: int, pp_rank: int, name: str) -> torch.Tensor:
        sd = shards[(tp_rank, pp_rank)]
        if name not in sd:
            raise InputError(f"missing from the state dict of (tp_rank, pp_rank) = "
                             f"({tp_rank}, {pp_rank})", source="megatron_state_dict", key=name)
        return sd[name]

    def cat(pp_rank: int, name: str, dim: int) -> torch.Tensor:
        return torch.cat([get(t, pp_rank, name) for t in tps], dim=dim)

    last = pp_size - 1
    out: dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": cat(0, EMBED, 0)[: spec.vocab_size].clone(),
        "model.norm.weight": _replicated([get(t, last, FINAL_NORM) for t in tps],
                                         "model.norm.weight"),
    }
    if not spec.tied_embeddings:
        out["lm_head.weight"] = cat(last, OUTPUT, 0)[: spec.vocab_size].clone()
    for pp_rank in range(pp_size):
        for local, layer in enumerate(stage_layers(spec, pp_rank, pp_size)):
            hf, mg = f"model.layers.{layer}.", f"decoder.layers.{local}."
            for mg_name, hf_name in _NORMS:
                out[hf + hf_name] = _replicated([get(t, pp_rank, mg + mg_name) for t in tps],
                                                hf + hf_name)
            for kind in ("weight", "bias") if spec.qkv_bias else ("weight",):
                fused = cat(pp_rank, f"{mg}self_attention.linear_qkv.{kind}", 0)
                q, k, v = split_qkv(fused, num_heads=nq, num_kv_heads=nkv, head_dim=hd)
                for p, t in zip("qkv", (q, k, v)):
                    out[f"{hf}self_attn.{p}_proj.{kind}"] = t
            out[hf + "self_attn.o_proj.weight"] = cat(
                pp_rank, mg + "self_attention.linear_proj.weight", 1)
            fc1 = [get(t, pp_rank, mg + "mlp.linear_fc1.weight") for t in tps]
            out[hf + "mlp.gate_proj.weight"] = torch.cat([f.chunk(2, dim=0)[0] for f in fc1], dim=0)
            out[hf + "mlp.up_proj.weight"] = torch.cat([f.chunk(2, dim=0)[1] for f in fc1], dim=0)
            out[hf + "mlp.down_proj.weight"] = cat(pp_rank, mg + "mlp.linear_fc2.weight", 1)
    return out


# --------------------------------------------------------------------------- with a live model

def unwrap_model(model: torch.nn.Module) -> torch.nn.Module:
    while hasattr(model, "module") and isinstance(model.module, torch.nn.Module):
        model = model.module  # megatron DDP / Float16Module wrappers
    return model


def load_hf_weights(model: torch.nn.Module, hf_sd: Mapping[str, torch.Tensor],
                    hf_config: Any) -> None:
    """Copy this rank's shard of ``hf_sd`` into ``model`` (strict: every parameter, no extras).

    Ranks come from ``megatron.core.parallel_state``. Values are cast to the model's dtype.
    """
    from megatron.core import parallel_state as ps  # lazy: megatron-core: optional, 4 s import

    sd = hf_to_megatron(hf_sd, hf_config,
                        tp_rank=ps.get_tensor_model_parallel_rank(),
                        tp_size=ps.get_tensor_model_parallel_world_size(),
                        pp_rank=ps.get_pipeline_model_parallel_rank(),
                        pp_size=ps.get_pipeline_model_parallel_world_size())
    params = dict(unwrap_model(model).named_parameters())
    missing, extra = sorted(set(params) - set(sd)), sorted(set(sd) - set(params))
    if missing or extra:
        raise InputError(f"state dict does not match the model: missing={missing} extra={extra}",
                         source="hf_state_dict")
    with torch.no_grad():
        for name, param in params.items():
            if param.shape != sd[name].shape:
                raise InputError(f"shape {tuple(sd[name].shape)} != model's {tuple(param.shape)}",
                                 source="hf_state_dict", key=name)
            param.copy_(sd[name])


def gather_hf_state_dict(model: torch.nn.Module, hf_config: Any, *,
                         tensors: Mapping[str, torch.Tensor] | None = None
                         ) -> dict[str, torch.Tensor]:
    """Collective over megatron's model-parallel group: the full HF state dict on every member.

    Every rank of the TP x PP group must call it. Each data-parallel replica gathers its own copy.
    ``tensors``: gather these instead of the parameters, keyed by local megatron parameter name
    (e.g. ``{n: p.main_grad for n, p in ...}`` to compare gradients under HF names).
    Tensors travel as raw bytes (:func:`~rlaudit.update.collectives.all_gather_tensor_dicts`);
    the result holds CPU copies.
    """
    from megatron.core import parallel_state as ps  # lazy: megatron-core: optional, 4 s import

    local = (dict(unwrap_model(model).named_parameters()) if tensors is None else dict(tensors))
    device = next(iter(local.values())).device if local else torch.device("cpu")
    group = ps.get_model_parallel_group()
    where = (ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank())
    gathered = all_gather_tensor_dicts(where, local, group=group,
                                       size=dist.get_world_size(group), device=device)
    return megatron_to_hf(dict(gathered), hf_config,
                          tp_size=ps.get_tensor_model_parallel_world_size(),
                          pp_size=ps.get_pipeline_model_parallel_world_size())


# --------------------------------------------------------------------------- files

def load_hf_checkpoint(folder: str | Path) -> tuple[Any, dict[str, torch.Tensor]]:
    """``(config, state_dict)`` of an HF model folder (config.json + *.safetensors, no download)."""
    # lazy: transformers: 2 s import, only where a model is built or loaded
    from safetensors.torch import load_file
    from transformers import AutoConfig  # lazy: as above

    folder = Path(folder)
    if not (folder / "config.json").is_file():
        raise InputError("not an HF model folder: config.json not found", source=str(folder))
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise InputError("no *.safetensors weights found", source=str(folder))
    try:
        config = AutoConfig.from_pretrained(folder, local_files_only=True)
    except (ValueError, OSError, json.JSONDecodeError) as e:
        raise InputError(f"cannot read the config: {e}", source=str(folder / "config.json")) from e
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(f))
    return config, state
