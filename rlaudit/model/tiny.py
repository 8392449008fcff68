"""Tiny HF-format causal LMs (Qwen2, Llama) and a byte-level tokenizer, built with no downloads.

The models are small enough for CPU CI (~0.4 M parameters, ~1.5 MB in fp32) yet exercise what a
real checkpoint does: grouped-query attention (4 query heads, 2 KV heads, head_dim 32), untied
embeddings, QKV bias (Qwen2), an explicit non-default ``rope_theta`` (a converter that forgets it
silently falls back to 10000 and is caught) and RMSNorm weights that are not all ones (a converter
that drops them is caught). Weights are drawn from a seeded ``torch.Generator``: the same seed gives
bit-identical weights on every run, whatever the caller's global RNG state.

Tokenizer: token id ``b`` is the byte ``b`` (0..255), then ``<pad>`` 256, ``<bos>`` 257,
``<eos>`` 258, then ``<reserved_k>`` specials up to the model's vocab size, so every id the model
can sample decodes. Text always encodes to its UTF-8 bytes (special-token names typed in text are
*not* turned into specials); no BOS is added implicitly.

Write a committed snapshot::

    python -m rlaudit.model.tiny --arch qwen2 --out scenarios/models/qwen2-tiny

or a blend of two snapshots of one architecture (a stand-in for an older checkpoint of a trained
policy: its weights moved part of the way back towards where training started)::

    python -m rlaudit.model.tiny --blend scenarios/models/qwen2-tiny-short \
        scenarios/models/qwen2-tiny --alpha 0.1 --out scenarios/models/qwen2-tiny-short-stale
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import shutil
import sys
from pathlib import Path
from typing import Any

import torch

import rlaudit
from rlaudit.errors import InputError
from rlaudit.model.hf_import import import_model_code

ARCHS = ("qwen2", "llama")
NUM_BYTES = 256
PAD_TOKEN, BOS_TOKEN, EOS_TOKEN = "<pad>", "<bos>", "<eos>"
PAD_ID, BOS_ID, EOS_ID = NUM_BYTES, NUM_BYTES + 1, NUM_BYTES + 2
NUM_BASE_TOKENS = NUM_BYTES + 3
#: A multiple of 8 >= 259 so the vocab splits evenly under tensor parallelism 2 and 4.
DEFAULT_VOCAB_SIZE = 264
#: Non-default RoPE base (HF/Megatron default 10000): a converter that drops it is caught.
DEFAULT_ROPE_THETA = 50000.0
#: Large enough to keep the tiny model's short contexts; small enough to keep vLLM's KV cache cheap.
DEFAULT_MAX_POSITIONS = 512

#: Std of weight matrices: N(0, 0.02) makes the next-token distribution ~uniform; 0.2 gives a
#: peaked but still diverse distribution (see `mean entropy` printed by the CLI).
INIT_STD = 0.2
#: Std of biases (Qwen2 QKV): non-zero so that a converter dropping the bias is caught.
BIAS_STD = 0.1
#: RMSNorm weights are 1 + N(0, 0.1): not all ones, so a converter dropping them is caught.
NORM_JITTER = 0.1

SNAPSHOT_META = "rlaudit_snapshot.json"
WEIGHTS_FILE = "model.safetensors"

_DEFAULTS: dict[str, Any] = dict(
    vocab_size=DEFAULT_VOCAB_SIZE, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=DEFAULT_MAX_POSITIONS,
    rms_norm_eps=1e-6, tie_word_embeddings=False,
    bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID,
)


# ---- tokenizer ---------------------------------------------------------------------------------
def byte_to_unicode() -> dict[int, str]:
    """The printable stand-in for each byte used by byte-level BPE (GPT-2's table).

    Printable latin-1 bytes stand for themselves; the other 68 bytes map, in increasing order, to
    code points 256, 257, ... so that every byte has a visible, non-whitespace character.
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(NUM_BYTES):
        if b not in table:
            table[b] = chr(NUM_BYTES + extra)
            extra += 1
    return table


def build_tokenizer(*, vocab_size: int = DEFAULT_VOCAB_SIZE):
    """The byte-level ``PreTrainedTokenizerFast`` (no network, no merges).

    Ids: bytes 0..255, ``<pad>``=256, ``<bos>``=257, ``<eos>``=258, then ``<reserved_0>``... up
    to ``vocab_size`` (so ``len(tokenizer) == vocab_size``). ``encode(text)`` returns exactly
    ``list(text.encode("utf-8"))``; ``decode`` is lossy only for byte sequences that are not UTF-8.
    """
    # lazy: transformers: 2 s import, only where a model is built or loaded
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast  # lazy: as above

    if vocab_size < NUM_BASE_TOKENS:
        raise InputError(f"must be >= {NUM_BASE_TOKENS} (256 bytes + pad, bos, eos), got "
                         f"{vocab_size}", key="vocab_size")
    vocab = {ch: b for b, ch in byte_to_unicode().items()}
    specials = [PAD_TOKEN, BOS_TOKEN, EOS_TOKEN]
    specials += [f"<reserved_{k}>" for k in range(vocab_size - NUM_BASE_TOKENS)]
    for tok in specials:
        vocab[tok] = len(vocab)
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None))
    # use_regex=False: no word splitting; each byte becomes one token.
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    core.add_special_tokens(specials)
    return PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token=PAD_TOKEN, bos_token=BOS_TOKEN, eos_token=EOS_TOKEN,
        model_max_length=DEFAULT_MAX_POSITIONS, split_special_tokens=True, padding_side="right",
        clean_up_tokenization_spaces=False)


# ---- model -------------------------------------------------------------------------------------
def tiny_config(arch: str, **overrides: Any):
    """The HF config of a tiny ``arch`` model: the defaults above updated by ``overrides``.

    ``overrides`` are HF config keys (``num_hidden_layers=4``, ``vocab_size=272``, ...); the
    convenience key ``rope_theta`` sets ``rope_parameters``. Unknown keys raise :class:`InputError`.
    """
    # lazy: transformers: 2 s import, only where a model is built or loaded
    from transformers import LlamaConfig, Qwen2Config

    classes = {"qwen2": Qwen2Config, "llama": LlamaConfig}
    if arch not in classes:
        raise InputError(f"unknown architecture {arch!r}; valid: {', '.join(ARCHS)}", key="arch")
    cls = classes[arch]
    known = set(cls().to_dict()) | {"rope_theta"}
    for key in overrides:
        if key not in known:
            raise InputError(f"not a {cls.__name__} key (e.g. hidden_size, num_hidden_layers, "
                             "vocab_size, rope_theta)", key=f"overrides.{key}")
    kwargs = {**_DEFAULTS, **overrides}
    theta = float(kwargs.pop("rope_theta", DEFAULT_ROPE_THETA))
    kwargs.setdefault("rope_parameters", {"rope_type": "default", "rope_theta": theta})
    if int(kwargs["vocab_size"]) < NUM_BASE_TOKENS:
        raise InputError(f"must be >= {NUM_BASE_TOKENS} for the byte-level tokenizer, got "
                         f"{kwargs['vocab_size']}", key="overrides.vocab_size")
    return cls(**kwargs)


def _init_weights_(model: torch.nn.Module, seed: int) -> None:
    """Overwrite every parameter of a freshly built ``model`` from a generator seeded by ``seed``
    (fp32 draws, in ``named_parameters`` order)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            if p.dim() >= 2:
                value = noise * INIT_STD
            elif "norm" in name:
                value = 1.0 + noise * NORM_JITTER
            else:
                value = noise * BIAS_STD
            p.copy_(value)


def build_tiny_model(arch: str, *, seed: int = 0, dtype: torch.dtype = torch.float32,
                     **overrides: Any):
    """A randomly initialised tiny ``arch`` ("qwen2" | "llama") causal LM, in eval mode.

    Deterministic: the weights depend only on ``arch``, ``seed`` and ``overrides`` (drawn in fp32
    and then cast, so the float64 model holds exactly the float32 weights). The caller's global
    RNG state is left untouched. Attention is ``"eager"`` (see :mod:`rlaudit.model.load`).
    """
    import_model_code()  # before transformers' model classes (see hf_import)
    # lazy: transformers: 2 s import, only where a model is built or loaded
    from transformers import AutoModelForCausalLM

    config = tiny_config(arch, **overrides)
    with torch.random.fork_rng(devices=[]):  # HF's own init draws from the global RNG
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32,
                                                 attn_implementation="eager")
    _init_weights_(model, seed)
    model = model.to(dtype)
    return model.eval()


def file_sha256(path: Path) -> str:
    """Hex sha256 of a file's bytes."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def save_snapshot(out_dir: str | Path, arch: str, *, seed: int = 0, **overrides: Any) -> Path:
    """Write a tiny fp32 model snapshot to ``out_dir`` (created if needed) and return its path.

    Files: ``config.json``, ``generation_config.json``, ``model.safetensors``, the tokenizer
    files, and ``rlaudit_snapshot.json`` (arch, seed, overrides, sha256 of the weights file,
    rlaudit/torch/transformers versions). Re-running with the same arguments rewrites identical
    weights.
    """
    import transformers  # lazy: transformers: 2 s import, only where a model is built or loaded

    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise InputError("exists and is not a directory", source=str(out), key="out_dir")
    out.mkdir(parents=True, exist_ok=True)
    model = build_tiny_model(arch, seed=seed, dtype=torch.float32, **overrides)
    model.save_pretrained(out, safe_serialization=True)
    build_tokenizer(vocab_size=model.config.vocab_size).save_pretrained(out)
    meta = {
        "arch": arch, "seed": seed, "overrides": dict(sorted(overrides.items())),
        "weights_sha256": file_sha256(out / WEIGHTS_FILE),
        "rlaudit_version": rlaudit.__version__, "torch_version": torch.__version__,
        "transformers_version": transformers.__version__,
    }
    (out / SNAPSHOT_META).write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
    return out


def save_blend(out_dir: str | Path, start: str | Path, towards: str | Path, alpha: float) -> Path:
    """Write ``theta = theta_start + alpha * (theta_towards - theta_start)`` (computed in float64,
    stored in ``start``'s dtypes) with ``start``'s config and tokenizer files to ``out_dir``.

    Both snapshots must have the same parameter names and shapes. ``alpha`` in (0, 1): 0 would be
    ``start`` itself. ``rlaudit_snapshot.json`` records both sources, alpha and the weights'
    sha256. Deterministic: the same inputs give identical bytes.
    """
    # lazy: transformers: 2 s import, only where a model is built or loaded
    from safetensors.torch import load_file, save_file

    start, towards, out = Path(start), Path(towards), Path(out_dir)
    if not 0 < alpha < 1:
        raise InputError(f"expected 0 < alpha < 1, got {alpha}", key="alpha")
    a, b = (load_file(str(p / WEIGHTS_FILE)) for p in (start, towards))
    if {k: tuple(v.shape) for k, v in a.items()} != {k: tuple(v.shape) for k, v in b.items()}:
        raise InputError(f"parameter names or shapes differ from {start}", source=str(towards))
    if out.exists() and not out.is_dir():
        raise InputError("exists and is not a directory", source=str(out), key="out_dir")
    out.mkdir(parents=True, exist_ok=True)
    for f in start.iterdir():
        if f.is_file() and f.name not in (WEIGHTS_FILE, SNAPSHOT_META):
            shutil.copyfile(f, out / f.name)
    blended = {k: (a[k].double() + alpha * (b[k].double() - a[k].double())).to(a[k].dtype)
               .contiguous() for k in sorted(a)}
    save_file(blended, str(out / WEIGHTS_FILE), metadata={"format": "pt"})
    meta = {"blended_from": start.name, "towards": towards.name, "alpha": alpha,
            "weights_sha256": file_sha256(out / WEIGHTS_FILE),
            "rlaudit_version": rlaudit.__version__, "torch_version": torch.__version__}
    (out / SNAPSHOT_META).write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
    return out


# ---- CLI ---------------------------------------------------------------------------------------
def _parse_override(text: str) -> tuple[str, Any]:
    key, sep, raw = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    try:
        return key, json.loads(raw)
    except json.JSONDecodeError:
        return key, raw


def mean_sample_entropy(model, *, num_tokens: int = 256, seed: int = 0) -> float:
    """Mean entropy (nats) of the next-token distribution along one temperature-1 sample of
    ``num_tokens`` tokens from ``<bos>`` (denominator: ``num_tokens``). Uniform = log(V)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.tensor([[model.config.bos_token_id]])
    total = 0.0
    past = None
    with torch.no_grad():
        for _ in range(num_tokens):
            out = model(input_ids=ids[:, -1:] if past is not None else ids,
                        past_key_values=past, use_cache=True)
            past = out.past_key_values
            logp = torch.log_softmax(out.logits[0, -1].double(), -1)
            total += float(-(logp.exp() * logp).sum())
            nxt = torch.multinomial(logp.exp(), 1, generator=gen)
            ids = torch.cat([ids, nxt.view(1, 1)], 1)
    return total / num_tokens


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rlaudit.model.tiny",
                                     description="Write a tiny HF model snapshot (no downloads).")
    parser.add_argument("--arch", choices=ARCHS)
    parser.add_argument("--out", required=True, help="output folder")
    parser.add_argument("--blend", nargs=2, metavar=("START", "TOWARDS"),
                        help="instead of a new model: START's weights moved --alpha of the way "
                             "towards TOWARDS's")
    parser.add_argument("--alpha", type=float, default=0.1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--set", dest="overrides", action="append", type=_parse_override,
                        default=[], metavar="KEY=VALUE",
                        help="HF config override, e.g. --set num_hidden_layers=4 (JSON values)")
    args = parser.parse_args(argv)
    if args.blend:
        try:
            path = save_blend(args.out, *args.blend, args.alpha)
        except InputError as err:
            print(f"error: {err}", file=sys.stderr)
            return err.exit_code
        meta = json.loads((path / SNAPSHOT_META).read_text())
        print(f"wrote {path}: weights sha256 {meta['weights_sha256'][:16]}")
        return 0
    if args.arch is None:
        parser.error("--arch is required (or --blend START TOWARDS)")
    try:
        path = save_snapshot(args.out, args.arch, seed=args.seed, **dict(args.overrides))
    except InputError as err:
        print(f"error: {err}", file=sys.stderr)
        return err.exit_code
    meta = json.loads((path / SNAPSHOT_META).read_text())
    model = build_tiny_model(args.arch, seed=args.seed, **dict(args.overrides))
    n_params = sum(p.numel() for p in model.parameters())
    entropy = mean_sample_entropy(model)
    uniform = math.log(model.config.vocab_size)
    print(f"wrote {path}: {n_params} parameters, weights sha256 {meta['weights_sha256'][:16]}, "
          f"mean entropy {entropy:.3f} nats/token (uniform {uniform:.3f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
