"""HF <-> Megatron weight conversion: layouts against hand-built expectations, exact round trips.

No processes and no megatron import: the converter is pure tensor code. Live-model checks (parity
with HF logits, gathering from real ranks) are in test_megatron_parity.py.
"""

from __future__ import annotations

import re

import pytest
import torch

from rlaudit.backends.megatron import convert
from rlaudit.backends.megatron.model import padded_vocab_size
from rlaudit.errors import CheckFailed, InputError
from rlaudit.model.tiny import build_tiny_model, save_snapshot

LAYOUTS = [(1, 1), (2, 1), (1, 2), (2, 2)]


@pytest.fixture(scope="module")
def qwen2():
    return build_tiny_model("qwen2", seed=1)


@pytest.fixture(scope="module")
def llama():
    return build_tiny_model("llama", seed=2)


def all_shards(hf_sd, config, tp, pp):
    return {(t, p): convert.hf_to_megatron(hf_sd, config, tp_rank=t, tp_size=tp, pp_rank=p,
                                           pp_size=pp)
            for t in range(tp) for p in range(pp)}


def test_interleave_qkv_matches_a_loop_over_query_groups():
    nq, nkv, hd, h = 6, 2, 3, 5
    q, k, v = (torch.randn(n * hd, h, dtype=torch.float64) for n in (nq, nkv, nkv))
    rows = []
    for g in range(nkv):  # per group: its nq/nkv query heads, then its k head, then its v head
        for head in range(g * nq // nkv, (g + 1) * nq // nkv):
            rows += [q[head * hd + i] for i in range(hd)]
        rows += [k[g * hd + i] for i in range(hd)]
        rows += [v[g * hd + i] for i in range(hd)]
    fused = convert.interleave_qkv(q, k, v, num_heads=nq, num_kv_heads=nkv, head_dim=hd)
    assert torch.equal(fused, torch.stack(rows))
    back = convert.split_qkv(fused, num_heads=nq, num_kv_heads=nkv, head_dim=hd)
    assert all(torch.equal(a, b) for a, b in zip(back, (q, k, v)))
    bias = convert.interleave_qkv(q[:, 0], k[:, 0], v[:, 0], num_heads=nq, num_kv_heads=nkv,
                                  head_dim=hd)
    assert torch.equal(bias, torch.stack(rows)[:, 0])


def test_tp2_shards_hold_the_expected_slices(qwen2):
    sd, cfg = qwen2.state_dict(), qwen2.config
    hd, r = 32, 2  # head_dim 128/4, query heads per group 4/2
    p = "model.layers.1."
    for rank in range(2):
        shard = convert.hf_to_megatron(sd, cfg, tp_rank=rank, tp_size=2)
        m = "decoder.layers.1."
        # rank r holds query group r: its 2 query heads, its k head, its v head (+ same for bias)
        q = sd[p + "self_attn.q_proj.weight"][rank * r * hd:(rank + 1) * r * hd]
        k = sd[p + "self_attn.k_proj.weight"][rank * hd:(rank + 1) * hd]
        v = sd[p + "self_attn.v_proj.weight"][rank * hd:(rank + 1) * hd]
        assert torch.equal(shard[m + "self_attention.linear_qkv.weight"], torch.cat([q, k, v]))
        qb = sd[p + "self_attn.q_proj.bias"][rank * r * hd:(rank + 1) * r * hd]
        assert torch.equal(shard[m + "self_attention.linear_qkv.bias"][: r * hd], qb)
        # fc1 = [gate rows of this rank; up rows of this rank]; 256 rows each in HF
        gate = sd[p + "mlp.gate_proj.weight"][rank * 128:(rank + 1) * 128]
        up = sd[p + "mlp.up_proj.weight"][rank * 128:(rank + 1) * 128]
        assert torch.equal(shard[m + "mlp.linear_fc1.weight"], torch.cat([gate, up]))
        # row-parallel: input columns
        assert torch.equal(shard[m + "self_attention.linear_proj.weight"],
                           sd[p + "self_attn.o_proj.weight"][:, rank * 64:(rank + 1) * 64])
        assert torch.equal(shard[m + "mlp.linear_fc2.weight"],
                           sd[p + "mlp.down_proj.weight"][:, rank * 128:(rank + 1) * 128])
        assert torch.equal(shard[m + "input_layernorm.weight"], sd[p + "input_layernorm.weight"])
        assert torch.equal(shard[m + "pre_mlp_layernorm.weight"],
                           sd[p + "post_attention_layernorm.weight"])
        assert torch.equal(shard["output_layer.weight"],
                           sd["lm_head.weight"][rank * 132:(rank + 1) * 132])


def test_pipeline_stages_split_layers_and_ends(llama):
    sd, cfg = llama.state_dict(), llama.config
    first = convert.hf_to_megatron(sd, cfg, pp_rank=0, pp_size=2)
    last = convert.hf_to_megatron(sd, cfg, pp_rank=1, pp_size=2)
    assert "embedding.word_embeddings.weight" in first and "output_layer.weight" not in first
    assert "decoder.final_layernorm.weight" in last
    assert "embedding.word_embeddings.weight" not in last
    assert not any(k.startswith("decoder.layers.1.") for k in (*first, *last))  # one layer each
    assert torch.equal(last["decoder.layers.0.input_layernorm.weight"],
                       sd["model.layers.1.input_layernorm.weight"])  # local 0 = global 1
    assert "decoder.layers.0.self_attention.linear_qkv.bias" not in first  # Llama: no qkv bias


def test_vocab_padding_rows_are_zero_and_dropped_on_the_way_back():
    hf = build_tiny_model("qwen2", seed=3, vocab_size=265)
    assert padded_vocab_size(265, 2) == 266
    shards = all_shards(hf.state_dict(), hf.config, 2, 1)
    for name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        assert shards[(0, 0)][name].shape[0] == shards[(1, 0)][name].shape[0] == 133
        assert torch.equal(shards[(1, 0)][name][-1], torch.zeros(128))
    back = convert.megatron_to_hf(shards, hf.config, tp_size=2, pp_size=1)
    assert back["lm_head.weight"].shape[0] == 265


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
@pytest.mark.parametrize("tp,pp", LAYOUTS)
def test_round_trip_is_exact(arch, tp, pp, qwen2, llama):
    hf = qwen2 if arch == "qwen2" else llama
    sd = hf.state_dict()
    back = convert.megatron_to_hf(all_shards(sd, hf.config, tp, pp), hf.config, tp_size=tp,
                                  pp_size=pp)
    assert set(back) == set(sd)
    assert all(torch.equal(back[k], sd[k]) for k in sd)
    assert all(back[k].untyped_storage().data_ptr() != sd[k].untyped_storage().data_ptr()
               for k in sd)  # new tensors: an update of one cannot show up in the other


def test_round_trip_tp4_padded_vocab_and_tied_embeddings():
    hf = build_tiny_model("llama", seed=4, vocab_size=262, num_key_value_heads=4,
                          tie_word_embeddings=True)
    sd = {k: v for k, v in hf.state_dict().items() if k != "lm_head.weight"}
    shards = all_shards(sd, hf.config, 4, 1)
    assert "output_layer.weight" not in shards[(0, 0)]
    back = convert.megatron_to_hf(shards, hf.config, tp_size=4, pp_size=1)
    assert set(back) == set(sd) and all(torch.equal(back[k], sd[k]) for k in sd)


def test_converter_does_not_mutate_its_input(qwen2):
    sd = {k: v.clone() for k, v in qwen2.state_dict().items()}
    versions = {k: v._version for k, v in sd.items()}
    shards = all_shards(sd, qwen2.config, 2, 2)
    for shard in shards.values():
        for t in shard.values():
            t.add_(1.0)  # writing to the output must not reach the input
    assert all(torch.equal(sd[k], v) for k, v in qwen2.state_dict().items())
    assert all(sd[k]._version == versions[k] for k in sd)


def test_diverged_tp_replicas_are_reported(qwen2):
    shards = all_shards(qwen2.state_dict(), qwen2.config, 2, 1)
    shards[(1, 0)]["decoder.layers.0.input_layernorm.weight"] += 1e-3
    with pytest.raises(CheckFailed, match="model.layers.0.input_layernorm.weight"):
        convert.megatron_to_hf(shards, qwen2.config, tp_size=2, pp_size=1)


def test_bad_inputs_name_what_is_wrong(qwen2):
    sd, cfg = qwen2.state_dict(), qwen2.config
    with pytest.raises(InputError, match="num_key_value_heads"):
        convert.hf_to_megatron(sd, cfg, tp_rank=0, tp_size=4)  # 2 kv heads
    with pytest.raises(InputError, match="num_hidden_layers"):
        convert.hf_to_megatron(sd, cfg, pp_rank=0, pp_size=3)
    with pytest.raises(InputError, match="tp_rank"):
        convert.hf_to_megatron(sd, cfg, tp_rank=2, tp_size=2)
    missing = {k: v for k, v in sd.items() if k != "model.layers.1.mlp.up_proj.weight"}
    with pytest.raises(InputError, match="model.layers.1.mlp.up_proj.weight"):
        convert.hf_to_megatron(missing, cfg)
    shards = all_shards(sd, cfg, 2, 1)
    del shards[(1, 0)]
    with pytest.raises(InputError, match=r"\(1, 0\)"):
        convert.megatron_to_hf(shards, cfg, tp_size=2, pp_size=1)


def test_load_hf_checkpoint_reads_a_snapshot(tmp_path):
    folder = save_snapshot(tmp_path / "m", "llama", seed=6)
    config, sd = convert.load_hf_checkpoint(folder)
    ref = build_tiny_model("llama", seed=6).state_dict()
    assert config.model_type == "llama"
    assert set(sd) == set(ref) and all(torch.equal(sd[k], ref[k]) for k in ref)
    with pytest.raises(InputError, match="config.json"):
        convert.load_hf_checkpoint(tmp_path)


@pytest.mark.parametrize("pp", [1, 2])
def test_module_map_covers_every_converted_parameter_and_matches_hf_modules(qwen2, pp):
    """module_names: each stage's megatron modules map to HF modules of the HF model itself, and
    every parameter hf_to_megatron gives a stage lives in a mapped module (same parent)."""
    model, config = qwen2, qwen2.config
    hf_modules = {n for n, _ in model.named_modules()}
    hf_sd = model.state_dict()
    seen = []
    for p in range(pp):
        names = convert.module_names(config, pp_rank=p, pp_size=pp)
        assert set(names.values()) <= hf_modules
        seen += list(names.values())
        for mg_param in convert.hf_to_megatron(hf_sd, config, pp_rank=p, pp_size=pp):
            parent = mg_param.rsplit(".", 1)[0]
            leaves = [m for m in names if not re.fullmatch(r"decoder\.layers\.\d+", m)]
            assert any(parent == m or parent.startswith(m + ".") for m in leaves), mg_param
    n = config.num_hidden_layers
    assert seen[0] == "model.embed_tokens" and seen[-2:] == ["model.norm", "lm_head"]
    assert seen[1:6] == ["model.layers.0.input_layernorm", "model.layers.0.self_attn",
                         "model.layers.0.post_attention_layernorm", "model.layers.0.mlp",
                         "model.layers.0"]
    assert len(seen) == 3 + 5 * n
