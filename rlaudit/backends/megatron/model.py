"""A megatron-core GPTModel equivalent to an HF Qwen2/Llama causal LM, and running it on a batch.

    spec   = hf_model_spec(hf_config)                   # validated dims, rotary base, biases
    cfg    = gpt_config_from_hf(hf_config, tp=2, pp=1)  # megatron TransformerConfig
    model  = build_gpt_model(hf_config)                 # this rank's stage, from parallel_state
    mask   = attention_mask_4d(attention_mask)          # [b, s] 1=token -> [b, 1, s, s] True=masked
    logits = model(input_ids, position_ids(input_ids), mask)   # last stage: [b, s, V_pad/tp]

The layer recipe (docs/internals.md, "Megatron backend"): local spec with ``torch.nn.RMSNorm``,
gated SiLU MLP (``gated_linear_unit=True``), no linear biases except Qwen2's q/k/v biases, grouped-query
attention (``num_query_groups``, ``kv_channels``), RoPE with the checkpoint's own ``rotary_base``
(transformers 5.x keeps it in ``config.rope_parameters``; falling back to megatron's default 10000
would silently give a different model).

Padding: only *right* padding is supported (megatron's RoPE ignores position ids and uses 0..s-1).
The vocabulary is padded to a multiple of ``tp`` (:func:`padded_vocab_size`); the padded output
columns hold logit 0 and must be excluded from log-probs/entropy (``vocab_size=`` argument of
:mod:`rlaudit.backends.megatron.vocab_parallel`).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Callable, Iterable, Mapping

import torch
import torch.nn.functional as F

from rlaudit.errors import InputError

SUPPORTED_MODEL_TYPES = ("qwen2", "llama")
_SOURCE = "config.json"  # where every value checked here comes from


@dataclass(frozen=True)
class HFModelSpec:
    """The facts of an HF Qwen2/Llama config that the Megatron model and the converter need."""

    model_type: str
    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    rotary_base: float
    rms_norm_eps: float
    qkv_bias: bool
    tied_embeddings: bool


def _get(cfg: Any, name: str, default: Any = None) -> Any:
    if isinstance(cfg, Mapping):
        return cfg.get(name, default)
    return getattr(cfg, name, default)


def _rotary_base(cfg: Any) -> float:
    params = _get(cfg, "rope_parameters")
    if params is None:  # transformers 4.x layout
        params = {"rope_type": "default", **(_get(cfg, "rope_scaling") or {})}
        if _get(cfg, "rope_theta") is not None:
            params["rope_theta"] = _get(cfg, "rope_theta")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default":
        raise InputError(f"rope_type {rope_type!r} is not supported (only 'default')",
                         source=_SOURCE, key="rope_parameters.rope_type")
    if params.get("rope_theta") is None:
        raise InputError("no rotary base; expected rope_parameters.rope_theta (or rope_theta)",
                         source=_SOURCE, key="rope_parameters.rope_theta")
    return float(params["rope_theta"])


def hf_model_spec(hf_config: Any) -> HFModelSpec:
    """Validate an HF config (``PretrainedConfig`` or config.json dict) and extract its dims.

    Raises InputError naming the config key for anything this backend cannot reproduce exactly
    (other architectures, biases other than Qwen2's q/k/v, non-SiLU MLPs, RoPE scaling, sliding
    window attention).
    """
    model_type = _get(hf_config, "model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise InputError(f"model_type {model_type!r} is not supported; expected one of "
                         f"{', '.join(SUPPORTED_MODEL_TYPES)}", source=_SOURCE, key="model_type")
    if _get(hf_config, "hidden_act", "silu") != "silu":
        raise InputError(f"hidden_act {_get(hf_config, 'hidden_act')!r}: only 'silu' is supported",
                         source=_SOURCE, key="hidden_act")
    for key in ("attention_bias", "mlp_bias", "use_sliding_window"):
        if _get(hf_config, key, False):
            raise InputError("must be false for the Megatron backend", source=_SOURCE, key=key)
    hidden = int(_get(hf_config, "hidden_size"))
    heads = int(_get(hf_config, "num_attention_heads"))
    kv_heads = int(_get(hf_config, "num_key_value_heads") or heads)
    head_dim = int(_get(hf_config, "head_dim") or hidden // heads)
    if heads % kv_heads:
        raise InputError(f"num_attention_heads {heads} is not a multiple of num_key_value_heads "
                         f"{kv_heads}", source=_SOURCE, key="num_key_value_heads")
    return HFModelSpec(
        model_type=model_type,
        num_layers=int(_get(hf_config, "num_hidden_layers")),
        hidden_size=hidden,
        ffn_hidden_size=int(_get(hf_config, "intermediate_size")),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        vocab_size=int(_get(hf_config, "vocab_size")),
        max_position_embeddings=int(_get(hf_config, "max_position_embeddings")),
        rotary_base=_rotary_base(hf_config),
        rms_norm_eps=float(_get(hf_config, "rms_norm_eps")),
        qkv_bias=model_type == "qwen2",  # Qwen2 always has q/k/v biases, Llama (checked above) none
        tied_embeddings=bool(_get(hf_config, "tie_word_embeddings", False)),
    )


def padded_vocab_size(vocab_size: int, tp: int) -> int:
    """Smallest multiple of ``tp`` that is >= ``vocab_size`` (megatron splits the vocab evenly)."""
    return -(-vocab_size // tp) * tp


def check_layout(spec: HFModelSpec, *, tp: int, pp: int) -> None:
    """Raise InputError if the model cannot be split ``tp`` x ``pp`` ways."""
    if spec.num_kv_heads % tp:
        raise InputError(f"num_key_value_heads {spec.num_kv_heads} is not divisible by tp={tp}",
                         source=_SOURCE, key="num_key_value_heads")
    if spec.ffn_hidden_size % tp:
        raise InputError(f"intermediate_size {spec.ffn_hidden_size} is not divisible by tp={tp}",
                         source=_SOURCE, key="intermediate_size")
    if spec.num_layers % pp:
        raise InputError(f"num_hidden_layers {spec.num_layers} is not divisible by pp={pp}",
                         source=_SOURCE, key="num_hidden_layers")
    if spec.tied_embeddings and pp > 1:
        raise InputError("tied embeddings are not supported with pipeline parallelism (pp > 1)",
                         source=_SOURCE, key="tie_word_embeddings")


def gpt_config_from_hf(hf_config: Any, *, tp: int = 1, pp: int = 1,
                       dtype: torch.dtype = torch.float32,
                       overrides: Mapping[str, Any] | None = None):
    """The megatron ``TransformerConfig`` reproducing ``hf_config`` under a ``tp`` x ``pp`` split.

    ``variable_seq_lengths`` is on: pipeline stages may exchange micro-batches of different shapes
    (dynamic batch sizes), at the cost of one extra shape message per pipeline send.
    ``overrides``: further TransformerConfig fields, e.g. ``{"calculate_per_token_loss": True}``
    (then neither the pipeline schedule nor megatron's DDP rescales the loss/gradients: what a
    loss that already divides by global denominators needs).
    """
    spec = hf_model_spec(hf_config)
    check_layout(spec, tp=tp, pp=pp)  # before importing megatron: errors stay cheap
    # lazy: megatron-core: optional, 4 s import
    from megatron.core.transformer.transformer_config import TransformerConfig

    known = {f.name for f in fields(TransformerConfig)}
    for key in overrides or {}:
        if key not in known:
            raise InputError("not a megatron TransformerConfig field", source="overrides", key=key)
    values = dict(
        num_layers=spec.num_layers,
        hidden_size=spec.hidden_size,
        ffn_hidden_size=spec.ffn_hidden_size,
        num_attention_heads=spec.num_heads,
        num_query_groups=spec.num_kv_heads,
        kv_channels=spec.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=spec.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=spec.qkv_bias,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        use_cpu_initialization=not torch.cuda.is_available(),
        variable_seq_lengths=True,
        # no MoE here, but the config rejects variable_seq_lengths with the default "allgather"
        moe_token_dispatcher_type="alltoall",
        # kept at megatron's defaults on purpose: rotary_interleaved=False (HF rotate_half layout),
        # masked_softmax_fusion/apply_rope_fusion/bias_dropout_fusion=False, sequence_parallel=False
    )
    values.update(overrides or {})
    return TransformerConfig(**values)


def build_gpt_model(hf_config: Any, *, dtype: torch.dtype = torch.float32,
                    parallel_output: bool = True, overrides: Mapping[str, Any] | None = None):
    """This rank's pipeline stage of the GPTModel for ``hf_config`` (weights not loaded).

    TP/PP sizes and this rank's PP stage come from ``megatron.core.parallel_state`` (call
    :func:`rlaudit.backends.megatron.compat.init_megatron` first). The first stage owns the
    embedding, the last one the final norm and output layer; with ``parallel_output=True`` the
    last stage returns logits sharded over the vocab: ``[b, s, padded_vocab_size(V, tp) // tp]``.
    Load weights with :func:`rlaudit.backends.megatron.convert.load_hf_weights`.
    ``overrides``: extra TransformerConfig fields (see :func:`gpt_config_from_hf`).
    """
    from megatron.core import parallel_state  # lazy: megatron-core: optional, 4 s import
    from megatron.core.models.gpt import GPTModel  # lazy: as above
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # lazy: as above

    tp = parallel_state.get_tensor_model_parallel_world_size()
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    spec = hf_model_spec(hf_config)
    config = gpt_config_from_hf(hf_config, tp=tp, pp=pp, dtype=dtype, overrides=overrides)
    model = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
        vocab_size=padded_vocab_size(spec.vocab_size, tp),
        max_sequence_length=spec.max_position_embeddings,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        parallel_output=parallel_output,
        share_embeddings_and_output_weights=spec.tied_embeddings,
        position_embedding_type="rope",
        rotary_base=spec.rotary_base,
        rotary_percent=1.0,
    )
    # torch.nn.RMSNorm (WrappedTorchNorm) ignores params_dtype: cast the whole stage once.
    # Module._apply keeps the Parameter objects, so megatron's TP attributes survive.
    return model.to(dtype)


def freeze_padding_embedding(model, hf_config) -> None:
    """Give megatron's word embedding HF's ``padding_idx`` semantics: the embedding row of
    ``pad_token_id`` never receives a gradient.

    HF Qwen2/Llama build ``nn.Embedding(vocab, hidden, padding_idx=pad_token_id)``, whose row for
    the pad token gets a zero gradient even where that token is a real input (a sampled pad
    token, or a pad that doubles as EOS, as Qwen's ``<|endoftext|>`` does); megatron's
    VocabParallelEmbedding has no such row and trains it. Found by backend-parity on rollouts
    whose responses contain the pad token. Each TP rank zeroes the row if it holds it; only the
    first pipeline stage has the embedding."""
    pad = getattr(hf_config, "pad_token_id", None)
    emb = getattr(getattr(model, "embedding", None), "word_embeddings", None)
    if pad is None or emb is None:
        return
    start = int(getattr(emb, "vocab_start_index", 0))
    end = int(getattr(emb, "vocab_end_index", emb.weight.shape[0]))
    if not start <= int(pad) < end:
        return
    row = int(pad) - start

    def zero_pad_row(grad):
        return grad.index_fill(0, torch.tensor([row], device=grad.device), 0.0)

    emb.weight.register_hook(zero_pad_row)


def attention_mask_4d(attention_mask: torch.Tensor) -> torch.Tensor:
    """HF-style padding mask -> megatron's attention mask.

    ``attention_mask``: ``[b, s]``, bool or 0/1, True/1 = a real token (right padding only).
    Returns a new ``[b, 1, s, s]`` bool tensor, **True = masked** (future keys and pad keys).
    Query rows of pad positions still see the real prefix, so no row is fully masked.
    """
    if attention_mask.dim() != 2:
        raise InputError(f"expected shape [b, s], got {tuple(attention_mask.shape)}",
                         key="attention_mask")
    s = attention_mask.shape[1]
    future = torch.ones(s, s, dtype=torch.bool, device=attention_mask.device).triu(1)
    pad_key = ~attention_mask.bool()[:, None, None, :]
    return future[None, None] | pad_key


def position_ids(input_ids: torch.Tensor) -> torch.Tensor:
    """``[b, s]`` positions 0..s-1 (megatron's RoPE uses these implicitly; right padding only)."""
    b, s = input_ids.shape
    return torch.arange(s, device=input_ids.device).expand(b, s).contiguous()


def pipeline_forward(model, micro_batches: Iterable[tuple[torch.Tensor, torch.Tensor]], *,
                     on_logits: Callable[[torch.Tensor, int], Any] | None = None) -> list | None:
    """Forward-only pass of micro-batches through megatron's pipeline schedule (any PP, incl. 1).

    ``micro_batches``: ``(input_ids [b, s], attention_mask [b, s])`` pairs, right-padded, 1 = token;
    shapes may differ between micro-batches. Every rank of the model-parallel group must pass the
    same micro-batches (inputs are only read on the first stage). Runs under ``torch.no_grad()``.

    Returns, on the last pipeline stage, one entry per micro-batch: the logits shard
    ``[b, s, V_pad/tp]`` or, if given, ``on_logits(logits_shard, index)`` (e.g. log-probs, so that
    full logits are not kept). Returns None on other stages.
    """
    from megatron.core import parallel_state  # lazy: megatron-core: optional, 4 s import
    from megatron.core.pipeline_parallel import get_forward_backward_func  # lazy: as above

    batches = list(micro_batches)
    if not batches:
        raise InputError("expected at least one micro-batch", key="micro_batches")
    counter = iter(range(len(batches)))

    def forward_step(data_iterator, stage):
        input_ids, attention_mask = next(data_iterator)
        index = next(counter)
        out = stage(input_ids, position_ids(input_ids), attention_mask_4d(attention_mask))
        if on_logits is None or not parallel_state.is_pipeline_last_stage():
            return out, None  # loss_func None: the schedule stores the output as is
        return on_logits(out, index), None

    b0, s0 = batches[0][0].shape
    with torch.no_grad():
        outputs = get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iter(batches), model=[model],
            num_microbatches=len(batches), seq_length=s0, micro_batch_size=b0, forward_only=True)
    return list(outputs) if parallel_state.is_pipeline_last_stage() else None
