"""Tiny models and the byte-level tokenizer: determinism, config, round trips, snapshots."""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

from rlaudit.errors import InputError
from rlaudit.model import tiny
from rlaudit.model.load import load_model, load_tokenizer

REPO = Path(__file__).resolve().parents[2]
COMMITTED = {arch: REPO / "scenarios" / "models" / f"{arch}-tiny" for arch in tiny.ARCHS}


@pytest.fixture(scope="module")
def tok():
    return tiny.build_tokenizer()


@pytest.fixture(scope="module")
def qwen2():
    return tiny.build_tiny_model("qwen2")


# ---- tokenizer ---------------------------------------------------------------------------------
def test_special_ids_and_size(tok):
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (256, 257, 258)
    assert len(tok) == 264
    assert tok.convert_ids_to_tokens([256, 257, 258, 259, 263]) == [
        "<pad>", "<bos>", "<eos>", "<reserved_0>", "<reserved_4>"]
    assert len(tiny.build_tokenizer(vocab_size=272)) == 272
    with pytest.raises(InputError, match="vocab_size"):
        tiny.build_tokenizer(vocab_size=258)


def test_byte_table_is_the_byte_level_alphabet():
    from tokenizers import pre_tokenizers

    table = tiny.byte_to_unicode()
    assert sorted(table) == list(range(256))
    assert len(set(table.values())) == 256
    assert set(table.values()) == set(pre_tokenizers.ByteLevel.alphabet())
    assert table[ord("a")] == "a" and table[0] == chr(256) and table[ord(" ")] == chr(256 + 32)


@given(st.text(max_size=40))
@example("e\u0301 <eos><pad> it's  ok\n\t\x00")  # NFC-able, special names, regex-splittable
@example("")
def test_text_round_trip_is_utf8_bytes(tok, text):
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert ids == list(text.encode("utf-8"))
    assert tok.decode(ids) == text


def test_decode_specials_and_bytes(tok):
    ids = [257] + list("héllo".encode()) + [258, 256]
    assert tok.decode(ids) == "<bos>héllo<eos><pad>"
    assert tok.decode(ids, skip_special_tokens=True) == "héllo"


# ---- model -------------------------------------------------------------------------------------
def test_same_seed_same_weights_and_global_rng_untouched():
    state = torch.get_rng_state()
    a = tiny.build_tiny_model("llama", seed=3)
    assert torch.equal(torch.get_rng_state(), state)
    torch.manual_seed(12345)  # the global RNG must not matter
    b = tiny.build_tiny_model("llama", seed=3)
    c = tiny.build_tiny_model("llama", seed=4)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(sa["lm_head.weight"], sc["lm_head.weight"])


def test_float64_model_holds_the_float32_weights():
    f32 = tiny.build_tiny_model("qwen2", seed=1)
    f64 = tiny.build_tiny_model("qwen2", seed=1, dtype=torch.float64)
    for (name, p32), (_, p64) in zip(f32.named_parameters(), f64.named_parameters()):
        assert p64.dtype == torch.float64
        assert torch.equal(p32.double(), p64), name


@pytest.mark.parametrize("arch", tiny.ARCHS)
def test_default_config(arch):
    model = tiny.build_tiny_model(arch)
    cfg = model.config
    assert cfg.vocab_size % 8 == 0 and cfg.vocab_size >= 259
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads) == (128, 4, 2)
    assert cfg.hidden_size // cfg.num_attention_heads == 32
    assert (cfg.num_hidden_layers, cfg.intermediate_size) == (2, 256)
    assert cfg.rope_parameters["rope_theta"] == 50000.0
    assert cfg._attn_implementation == "eager"
    params = dict(model.named_parameters())
    assert params["lm_head.weight"].data_ptr() != params["model.embed_tokens.weight"].data_ptr()
    assert ("model.layers.0.self_attn.q_proj.bias" in params) == (arch == "qwen2")
    norm = params["model.layers.0.input_layernorm.weight"]
    assert not torch.allclose(norm, torch.ones_like(norm))
    assert not model.training


def test_overrides_and_bad_input():
    model = tiny.build_tiny_model("llama", num_hidden_layers=1, vocab_size=272, rope_theta=1e4)
    assert model.config.num_hidden_layers == 1 and len(model.model.layers) == 1
    assert model.lm_head.weight.shape == (272, 128)
    assert model.config.rope_parameters["rope_theta"] == 1e4
    with pytest.raises(InputError, match="overrides.hidden_sise"):
        tiny.build_tiny_model("llama", hidden_sise=64)
    with pytest.raises(InputError, match="vocab_size"):
        tiny.build_tiny_model("qwen2", vocab_size=200)
    with pytest.raises(InputError, match="arch.*valid: qwen2, llama"):
        tiny.build_tiny_model("gpt2")


def test_output_distribution_is_peaked_but_diverse(qwen2):
    uniform = math.log(qwen2.config.vocab_size)
    entropy = tiny.mean_sample_entropy(qwen2, num_tokens=48)
    assert 1.0 < entropy < uniform - 1.0


# ---- an independent float64 forward: the config means what we think -----------------------------
def _rms(x, w, eps):
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w


def _naive_logits(model, ids: list[int], rope_theta: float) -> torch.Tensor:
    """Llama/Qwen2 forward written from the architecture description, float64, per head."""
    p = {k: v.detach().double() for k, v in model.state_dict().items()}
    cfg = model.config
    n_h, n_kv = cfg.num_attention_heads, cfg.num_key_value_heads
    hd = cfg.hidden_size // n_h
    eps = cfg.rms_norm_eps
    seq = len(ids)
    inv = rope_theta ** (-torch.arange(0, hd, 2, dtype=torch.float64) / hd)
    ang = torch.arange(seq, dtype=torch.float64)[:, None] * inv[None]   # [T, hd/2]
    cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)

    def rope(x):  # x [T, hd]; rotate pairs (i, i + hd/2)
        rot = torch.cat([-x[:, hd // 2:], x[:, :hd // 2]], -1)
        return x * cos + rot * sin

    x = p["model.embed_tokens.weight"][ids]
    for layer in range(cfg.num_hidden_layers):
        pre = f"model.layers.{layer}."
        h = _rms(x, p[pre + "input_layernorm.weight"], eps)
        proj = {}
        for name in "qkv":
            w = p[pre + f"self_attn.{name}_proj.weight"]
            proj[name] = h @ w.T + p.get(pre + f"self_attn.{name}_proj.bias", 0.0)
        heads = []
        for head in range(n_h):
            g = head // (n_h // n_kv)
            q = rope(proj["q"][:, head * hd:(head + 1) * hd])
            k = rope(proj["k"][:, g * hd:(g + 1) * hd])
            v = proj["v"][:, g * hd:(g + 1) * hd]
            scores = q @ k.T / math.sqrt(hd)
            causal = torch.ones(seq, seq, dtype=torch.bool).triu(1)
            scores = scores.masked_fill(causal, float("-inf"))
            heads.append(torch.softmax(scores, -1) @ v)
        x = x + torch.cat(heads, -1) @ p[pre + "self_attn.o_proj.weight"].T
        h = _rms(x, p[pre + "post_attention_layernorm.weight"], eps)
        gate = h @ p[pre + "mlp.gate_proj.weight"].T
        up = h @ p[pre + "mlp.up_proj.weight"].T
        x = x + (torch.nn.functional.silu(gate) * up) @ p[pre + "mlp.down_proj.weight"].T
    x = _rms(x, p["model.norm.weight"], eps)
    return x @ p["lm_head.weight"].T


@pytest.mark.parametrize("arch", tiny.ARCHS)
def test_hf_forward_matches_naive_float64(arch):
    model = tiny.build_tiny_model(arch, seed=2, dtype=torch.float64)
    ids = [257, 72, 101, 108, 108, 111, 44, 32, 200, 3, 258, 9]
    with torch.no_grad():
        hf = model(torch.tensor([ids])).logits[0]
    naive = _naive_logits(model, ids, rope_theta=50000.0)
    # HF upcasts RMSNorm / softmax / RoPE to float32 internally: ~1e-6 here, not ~1e-13.
    assert (hf - naive).abs().max() < 1e-4
    # ... and the check is sharp enough to catch a converter that forgets rope_theta.
    wrong = _naive_logits(model, ids, rope_theta=10000.0)
    assert (hf - wrong).abs().max() > 1e-2
    assert naive.abs().max() > 1.0  # logits are not ~0


# ---- snapshots ---------------------------------------------------------------------------------
def test_snapshot_round_trip(tmp_path):
    out = tiny.save_snapshot(tmp_path / "snap", "llama", seed=5, num_hidden_layers=1)
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", tiny.SNAPSHOT_META} <= names
    meta = json.loads((out / tiny.SNAPSHOT_META).read_text())
    digest = hashlib.sha256((out / "model.safetensors").read_bytes()).hexdigest()
    assert meta["weights_sha256"] == digest
    assert (meta["arch"], meta["seed"], meta["overrides"]) == ("llama", 5, {"num_hidden_layers": 1})
    loaded = load_model(out)
    built = tiny.build_tiny_model("llama", seed=5, num_hidden_layers=1)
    sl, sb = loaded.state_dict(), built.state_dict()
    assert sorted(sl) == sorted(sb) and all(torch.equal(sl[k], sb[k]) for k in sl)
    assert loaded.config.rope_parameters["rope_theta"] == 50000.0
    tok = load_tokenizer(out)
    assert len(tok) == 264 and tok.eos_token_id == 258
    assert tok("é<eos>", add_special_tokens=False)["input_ids"] == list("é<eos>".encode())
    # rewriting gives byte-identical weights
    again = tiny.save_snapshot(tmp_path / "again", "llama", seed=5, num_hidden_layers=1)
    assert (again / "model.safetensors").read_bytes() == (out / "model.safetensors").read_bytes()


def test_snapshot_into_a_file_is_an_input_error(tmp_path):
    target = tmp_path / "file"
    target.write_text("x")
    with pytest.raises(InputError, match="not a directory"):
        tiny.save_snapshot(target, "qwen2")


@pytest.mark.parametrize("arch", tiny.ARCHS)
def test_committed_snapshot_is_what_the_code_builds(arch):
    """Guards the committed files against drift of the init code (and the reverse)."""
    folder = COMMITTED[arch]
    meta = json.loads((folder / tiny.SNAPSHOT_META).read_text())
    assert (meta["arch"], meta["seed"], meta["overrides"]) == (arch, 0, {})
    loaded = load_model(folder)
    built = tiny.build_tiny_model(arch, seed=0)
    sl, sb = loaded.state_dict(), built.state_dict()
    assert all(torch.equal(sl[k], sb[k]) for k in sb)
    assert (folder / "model.safetensors").stat().st_size < 4 << 20


def test_cli_writes_a_snapshot(tmp_path, capsys):
    rc = tiny.main(["--arch", "qwen2", "--out", str(tmp_path / "m"), "--seed", "1",
                    "--set", "num_hidden_layers=1"])
    assert rc == 0
    assert "mean entropy" in capsys.readouterr().out
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 1 and cfg["model_type"] == "qwen2"
    assert tiny.main(["--arch", "qwen2", "--out", str(tmp_path / "n"), "--set", "nope=1"]) == 2


def test_blend_is_the_committed_stale_snapshot_and_interpolates(tmp_path):
    """scenarios/models/qwen2-tiny-short-stale is reproducible from its recipe, and every weight
    is start + 0.1 * (towards - start) up to float32 rounding (computed here elementwise)."""
    from safetensors.torch import load_file

    from rlaudit.model.tiny import save_blend
    models = Path(__file__).resolve().parents[2] / "scenarios" / "models"
    out = save_blend(tmp_path / "stale", models / "qwen2-tiny-short", models / "qwen2-tiny", 0.1)
    committed = models / "qwen2-tiny-short-stale"
    assert (out / "model.safetensors").read_bytes() == \
        (committed / "model.safetensors").read_bytes()
    a = load_file(str(models / "qwen2-tiny-short" / "model.safetensors"))
    b = load_file(str(models / "qwen2-tiny" / "model.safetensors"))
    c = load_file(str(out / "model.safetensors"))
    name = sorted(a)[0]
    x, y, z = a[name].flatten()[:5].tolist(), b[name].flatten()[:5].tolist(), c[name].flatten()[:5]
    want = torch.tensor([p + 0.1 * (q - p) for p, q in zip(x, y)], dtype=torch.float32)
    assert torch.equal(z, want)
    with pytest.raises(InputError):
        save_blend(tmp_path / "bad", models / "qwen2-tiny-short", models / "qwen2-tiny", 1.5)
