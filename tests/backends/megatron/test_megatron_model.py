"""HF config validation, vocab padding and the attention-mask/position helpers (no megatron import).

The models themselves are checked against HF logits in test_megatron_parity.py.
"""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, Qwen2Config

from rlaudit.backends.megatron.model import (attention_mask_4d, check_layout, gpt_config_from_hf,
                                             hf_model_spec, padded_vocab_size, position_ids)
from rlaudit.errors import InputError
from rlaudit.model.tiny import tiny_config


def test_spec_reads_dims_biases_and_the_explicit_rotary_base():
    q = hf_model_spec(tiny_config("qwen2"))
    assert (q.num_layers, q.hidden_size, q.ffn_hidden_size) == (2, 128, 256)
    assert (q.num_heads, q.num_kv_heads, q.head_dim, q.vocab_size) == (4, 2, 32, 264)
    assert q.rotary_base == 50000.0  # from config.rope_parameters, not megatron's 10000
    assert q.qkv_bias and not q.tied_embeddings
    llama = hf_model_spec(LlamaConfig(hidden_size=64, num_attention_heads=2, rope_theta=123.0))
    assert llama.rotary_base == 123.0 and not llama.qkv_bias and llama.num_kv_heads == 2


def test_spec_accepts_a_transformers_4_style_config_dict():
    cfg = {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4,
           "num_key_value_heads": 2, "num_hidden_layers": 2, "intermediate_size": 128,
           "vocab_size": 300, "max_position_embeddings": 64, "rms_norm_eps": 1e-5,
           "rope_theta": 5e5, "rope_scaling": None}
    spec = hf_model_spec(cfg)
    assert spec.rotary_base == 5e5 and spec.head_dim == 16


@pytest.mark.parametrize("config,key", [
    (LlamaConfig(rope_parameters={"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0,
                                  "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                  "original_max_position_embeddings": 8192}),
     "rope_parameters.rope_type"),
    (LlamaConfig(attention_bias=True), "attention_bias"),
    (LlamaConfig(mlp_bias=True), "mlp_bias"),
    (LlamaConfig(hidden_act="gelu"), "hidden_act"),
    (Qwen2Config(use_sliding_window=True), "use_sliding_window"),
    ({"model_type": "mistral"}, "model_type"),
])
def test_unsupported_configs_name_the_key(config, key):
    with pytest.raises(InputError, match=key.replace(".", r"\.")) as info:
        hf_model_spec(config)
    assert info.value.key == key and info.value.source == "config.json"


def test_layout_checks_are_input_errors_before_megatron_is_needed():
    spec = hf_model_spec(tiny_config("llama", tie_word_embeddings=True))
    with pytest.raises(InputError, match="num_key_value_heads"):
        check_layout(spec, tp=4, pp=1)
    with pytest.raises(InputError, match="tie_word_embeddings"):
        check_layout(spec, tp=1, pp=2)
    with pytest.raises(InputError, match="intermediate_size"):
        gpt_config_from_hf(tiny_config("qwen2", intermediate_size=250, num_key_value_heads=4),
                           tp=4)


@pytest.mark.parametrize("vocab,tp,expected", [(264, 2, 264), (265, 2, 266), (5, 4, 8), (1, 1, 1)])
def test_padded_vocab_size(vocab, tp, expected):
    assert padded_vocab_size(vocab, tp) == expected


def test_attention_mask_4d_is_causal_or_pad_key():
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]])
    out = attention_mask_4d(mask)
    assert out.shape == (2, 1, 4, 4) and out.dtype == torch.bool
    for b in range(2):
        for i in range(4):
            for j in range(4):
                assert bool(out[b, 0, i, j]) == (j > i or mask[b, j].item() == 0)
    assert not out.all(dim=-1).any()  # no query row is fully masked (right padding)
    with pytest.raises(InputError, match="attention_mask"):
        attention_mask_4d(torch.ones(4))


def test_position_ids_count_from_zero_per_row():
    ids = torch.zeros(2, 3, dtype=torch.long)
    assert torch.equal(position_ids(ids), torch.tensor([[0, 1, 2], [0, 1, 2]]))
