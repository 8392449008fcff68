"""Loading a local HF model folder (a tiny snapshot, or a real checkpoint on GPU machines).

Never downloads: every call passes ``local_files_only=True`` and a path that must exist. Weights
must be safetensors (rlaudit never unpickles). A missing or malformed folder raises
:class:`rlaudit.errors.InputError` naming the path and what is missing; a checkpoint whose tensors
do not match its config (missing, unexpected or mis-shaped weights, which HF would silently
re-initialise or drop) is an error too.

Attention is ``"eager"`` so that every backend computes the same softmax.

What float64 gives: float64 parameters and activations, deterministic, but *not* float64
accuracy. HF computes three things in float32 inside the float64 model: the RoPE frequencies and
cos/sin (``inv_freq`` is even built in float32 before the cast), RMSNorm's variance, and the
eager attention softmax. Measured on the tiny models against an independent float64 forward
(tests/model/test_tiny.py): logits (magnitude ~10) differ by ~1e-5, the same as float32 (2e-5);
replacing all three with float64 code brings it to ~3e-14. A forward that needs true float64
(e.g. for 1e-10 parity checks) must do those three in float64 itself.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

from rlaudit.errors import InputError
from rlaudit.model.exact import exact_float64
from rlaudit.model.hf_import import import_model_code
from rlaudit.stamps import file_stamps

CONFIG_FILE = "config.json"
#: Files HF tokenizers are loaded from; one of the first two is enough.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")
#: Length of :func:`snapshot_id` (hex chars of a sha256: 64 bits, plenty for provenance).
SNAPSHOT_ID_CHARS = 16
#: config.json keys that record who wrote the file, not what the model is.
_VOLATILE_CONFIG_KEYS = ("transformers_version", "_name_or_path")
#: tokenizer_config.json classes that mean "exactly what tokenizer.json says".
_GENERIC_TOKENIZER_CLASSES = (None, "TokenizersBackend", "PreTrainedTokenizerFast")


def _folder(path: str | Path) -> Path:
    folder = Path(path)
    if not folder.exists():
        raise InputError("model folder does not exist", source=str(folder))
    if not folder.is_dir():
        raise InputError("expected a model folder (config.json, *.safetensors, tokenizer files), "
                         "got a file", source=str(folder))
    return folder


def _read_config(folder: Path) -> dict:
    cfg = folder / CONFIG_FILE
    if not cfg.is_file():
        raise InputError("missing config.json (an HF model folder has config.json, "
                         "*.safetensors and tokenizer files)", source=str(folder))
    try:
        data = json.loads(cfg.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise InputError(f"malformed JSON: {err}", source=str(cfg)) from None
    if not isinstance(data, dict) or "model_type" not in data:
        raise InputError("expected a JSON object with a 'model_type' key", source=str(cfg),
                         key="model_type")
    return data


def weight_files(path: str | Path) -> list[Path]:
    """The ``*.safetensors`` files of a model folder, sorted by name.

    Raises :class:`InputError` if there are none (pickle ``*.bin`` checkpoints are refused) or if
    a sharded checkpoint's index names a shard that is not there.
    """
    folder = _folder(path)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        pickled = sorted(p.name for p in folder.glob("*.bin"))
        hint = (f" (found {', '.join(pickled)}: pickle checkpoints are not loaded; convert them to "
                "safetensors)") if pickled else ""
        raise InputError(f"no *.safetensors weight files{hint}", source=str(folder))
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = set(json.loads(index.read_text())["weight_map"].values())
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as err:
            raise InputError(f"malformed safetensors index ({err!r})", source=str(index),
                             key="weight_map") from None
        missing = sorted(s for s in shards if not (folder / s).is_file())
        if missing:
            raise InputError(f"index names missing shard(s): {', '.join(missing)}",
                             source=str(index), key="weight_map")
    return files


def load_model(path: str | Path, *, dtype: torch.dtype = torch.float32,
               device: str | torch.device = "cpu"):
    """Load the causal LM in ``path`` with eager attention, in eval mode, on ``device``.

    ``dtype`` is the parameter/activation dtype (float32, float64, bfloat16, ...). A float64 model
    is made to compute in float64 throughout (:func:`rlaudit.model.exact.exact_float64`). Raises :class:`InputError` for a missing
    or malformed folder and for weights that do not match the config.
    """
    folder = _folder(path)
    _read_config(folder)
    weight_files(folder)

    import_model_code()  # without scikit-learn's second of imports (see hf_import)
    # lazy: transformers: 2 s import, only where a model is built or loaded
    from transformers import AutoModelForCausalLM  # after the checks: errors come fast
    from transformers.utils import logging as hf_logging  # lazy: as above

    # no "Loading weights" bars: noise in every rank's log, and tqdm's multiprocessing lock
    # leaks a semaphore from every spawned rank (ranks leave with os._exit)
    hf_logging.disable_progress_bar()

    try:
        model, info = AutoModelForCausalLM.from_pretrained(
            folder, dtype=dtype, local_files_only=True, use_safetensors=True,
            attn_implementation="eager", output_loading_info=True)
    except torch.OutOfMemoryError:
        raise
    except (OSError, ValueError, KeyError, RuntimeError) as err:  # RuntimeError: size mismatch
        raise InputError(f"cannot load model: {err}", source=str(folder)) from err
    problems = {k: v for k in ("missing_keys", "unexpected_keys", "mismatched_keys")
                if (v := info.get(k))}
    if problems:
        detail = "; ".join(f"{k}: {sorted(map(str, v))[:5]}" for k, v in problems.items())
        raise InputError(f"weights do not match config.json ({detail})", source=str(folder))
    model = model.to(device).eval()
    if dtype == torch.float64:
        exact_float64(model)
    return model


def load_tokenizer(path: str | Path):
    """Load the tokenizer in ``path`` (local files only). Raises :class:`InputError` if the folder
    has no tokenizer files or they cannot be read.

    A folder whose ``tokenizer_config.json`` names a generic class (``TokenizersBackend``,
    ``PreTrainedTokenizerFast``) is loaded exactly as its ``tokenizer.json`` says. ``AutoTokenizer``
    is not used for those: transformers 5 forces the model type's own class for some types
    (``qwen2`` among them), which rebuilds the pipeline (adds an NFC normaliser, a word-splitting
    regex and an ``<|endoftext|>`` token) and so would break the tiny byte-level tokenizer.
    """
    folder = _folder(path)
    if not any((folder / name).is_file() for name in TOKENIZER_FILES[:2]):
        raise InputError(f"no tokenizer files (expected one of {', '.join(TOKENIZER_FILES[:2])})",
                         source=str(folder))
    tok_config = folder / TOKENIZER_FILES[2]
    try:
        declared = json.loads(tok_config.read_text()) if tok_config.is_file() else {}
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise InputError(f"malformed JSON: {err}", source=str(tok_config)) from None
    generic = (isinstance(declared, dict) and (folder / TOKENIZER_FILES[0]).is_file()
               and declared.get("tokenizer_class") in _GENERIC_TOKENIZER_CLASSES)

    import_model_code()  # AutoTokenizer brings the model code too (see hf_import)
    # lazy: transformers: 2 s import, only where a model is built or loaded
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    loader = PreTrainedTokenizerFast if generic else AutoTokenizer
    try:
        return loader.from_pretrained(folder, local_files_only=True)
    except (OSError, ValueError, KeyError) as err:
        raise InputError(f"cannot load tokenizer: {err}", source=str(folder)) from err


def snapshot_id(path: str | Path) -> str:
    """A short content id of a model folder: sha256 over the canonical config (sorted keys, minus
    ``transformers_version``) and the bytes of every weight file, in name order.

    The same weights and config give the same id wherever the folder lives; tokenizer files and
    generation settings do not enter it.
    """
    folder = _folder(path)
    config = _read_config(folder)
    files = weight_files(folder)
    for key in _VOLATILE_CONFIG_KEYS:
        config.pop(key, None)
    canonical = json.dumps(config, sort_keys=True, separators=(",", ":"))
    stamp = (canonical, file_stamps(files))
    known = _SNAPSHOT_IDS.get(stamp)
    if known is not None:
        return known
    digest = hashlib.sha256()
    digest.update(canonical.encode())
    for file in files:
        digest.update(b"\0" + file.name.encode() + b"\0")
        with open(file, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                digest.update(chunk)
    _SNAPSHOT_IDS[stamp] = out = digest.hexdigest()[:SNAPSHOT_ID_CHARS]
    return out


#: snapshot ids already computed in this process, by canonical config and the stamps of the weight
#: files (a scenario asks for its model's id several times: memo keys, provenance, goldens)
_SNAPSHOT_IDS: dict[tuple, str] = {}

