"""The validation pass of an invocation: every input is checked before the first replay, and all
problems are reported together, each naming its file and key (exit 2, nothing run).

    scenarios = validate_invocation(paths, backends=["reference"], golden_dir="golden")

Per scenario:

- the scenario file (:func:`rlaudit.scenarios.spec.load_scenario`: keys, types, names, paths);
- its model and reference-model snapshots: config.json, every weight file (a safetensors header
  that is readable and covers the file), tokenizer files;
- every backend layout the scenario declares -- not only those this invocation runs -- against
  the model's dimensions (megatron: tp divides the KV heads and the MLP width, pp the layers, no
  tied embeddings with pp > 1) and, on CUDA, against the visible devices;
- its rollout: hashes, fields, shapes, finite values (:func:`rlaudit.data.io.load_rollout`), the
  sampling temperature against the config, and that its replay is possible and not degenerate
  (:func:`rlaudit.scenarios.variants.replayable_variants`, which the engine runs too);
- its golden file when there is one (:func:`rlaudit.scenarios.golden.read_golden`).
"""

from __future__ import annotations

import json
from pathlib import Path

import safetensors
import torch

from rlaudit.backends.megatron.model import check_layout, hf_model_spec
from rlaudit.backends.registry import backend_names
from rlaudit.data.io import load_rollout
from rlaudit.data.ranges import check_rollout_values, vocab_size_of
from rlaudit.errors import InputError, InputErrors, Problems, raise_problems
from rlaudit.model.load import TOKENIZER_FILES, snapshot_id, weight_files
from rlaudit.model.snapshot_check import check_weights_hash
from rlaudit.scenarios.bounds import duplicate_names
from rlaudit.scenarios.golden import golden_path, read_golden
from rlaudit.scenarios.spec import load_scenario
from rlaudit.scenarios.variants import check_sampling_matches, replayable_variants
from rlaudit.update import forward_memo
from rlaudit.update.step import select_groups

#: header of the combined message
HEADER = "input problems; nothing was run"


# ---- the invocation ---------------------------------------------------------------------------

def validate_invocation(paths: list[Path], *, backends: list[str] | None = None,
                        golden_dir: str | Path | None = None,
                        device: str | None = None) -> list:
    """Load and check every scenario of an invocation (see the module docstring). Returns the
    scenarios (with ``device`` applied); raises the InputError(s) found, all together."""
    problems = Problems()
    problems.attempt(forward_memo.from_env)  # $RLAUDIT_FORWARD_MEMO, read by every replay
    for b in backends or []:
        if b not in backend_names():
            problems.add(f"unknown backend {b!r}; valid: {', '.join(backend_names())}",
                         source=None, key="--backend")
    scenarios = []
    for path in paths:
        scn = problems.attempt(load_scenario, path)
        if scn is None:
            continue
        if device:
            scn.device = device
        scenarios.append(scn)
    for err in duplicate_names(scenarios):
        problems.take(err)
    cache: dict = {}
    for scn in scenarios:
        check_scenario_inputs(scn, problems, golden_dir=golden_dir, cache=cache)
    raise_problems(problems.items, header=HEADER)
    return scenarios


def check_scenario_inputs(scn, problems: Problems, *, golden_dir: str | Path | None = None,
                          cache: dict | None = None) -> None:
    """Every input of one loaded scenario; problems are added to ``problems``."""
    cache = {} if cache is None else cache
    src = str(scn.path)
    model_cfgs = []
    for key, model in (("model", scn.model), ("ref_model", scn.ref_model)):
        if model is None:
            continue
        cfg = _cached(cache, ("model", str(model)), problems, _check_model, model,
                      wrap=(src, key))
        if cfg is not None:
            model_cfgs.append(cfg)
            check_layouts(scn, cfg, problems, key=key)
    batch = _cached(cache, ("rollout", str(scn.rollout)), problems, load_rollout, scn.rollout)
    if batch is not None:  # None with ids outside the vocabulary or a mis-shaped field
        batch = problems.attempt(check_rollout_values, batch, source=str(scn.rollout),
                                 vocab_size=vocab_size_of(*model_cfgs))
    if batch is not None and len(batch):
        if not batch.num_tokens():
            problems.add("False everywhere: no token to train on, so every check would pass "
                         "vacuously", source=str(scn.rollout), key="response_mask")
        else:
            filtered = problems.attempt(lambda: select_groups(batch, scn.config)[0])
            if filtered is not None:
                problems.attempt(check_sampling_matches, scn, filtered)
                try:
                    replayable_variants(scn, filtered)
                except InputErrors as e:
                    for p in e.problems:
                        problems.take(p)
                except InputError as e:
                    problems.take(e)
    if golden_dir is not None:
        path = golden_path(Path(golden_dir), scn)
        if path.exists():
            _cached(cache, ("golden", str(path)), problems, read_golden, path)


def _cached(cache: dict, key, problems: Problems, fn, *args, wrap=None):
    """``fn(*args)`` once per ``key`` (a model or rollout shared by scenarios is read once); a
    failure is recorded (wrapped per caller) and remembered as None."""
    if key not in cache:
        try:
            cache[key] = (fn(*args), None)
        except InputError as e:
            cache[key] = (None, e)
    value, err = cache[key]
    if err is not None:
        if wrap is None:
            problems.take(err)
        else:
            problems.add(str(err), source=wrap[0], key=wrap[1])
    return value


def _check_model(path: Path) -> dict:
    """A model snapshot's config.json (returned), complete weight files, tokenizer files."""
    snapshot_id(path)  # config.json parses, weight files exist and read
    for f in weight_files(path):
        try:
            with safetensors.safe_open(str(f), "pt") as sf:
                sf.keys()
        except Exception as e:  # noqa: BLE001 - safetensors raises its own error types
            raise InputError(f"not a complete safetensors file (truncated or corrupt?): {e}",
                             source=str(f)) from None
    check_weights_hash(path)  # an rlaudit snapshot's weights are the ones it recorded
    if not any((Path(path) / name).is_file() for name in TOKENIZER_FILES):
        raise InputError(f"no tokenizer files (expected one of {', '.join(TOKENIZER_FILES[:2])})",
                         source=str(path))
    return json.loads((Path(path) / "config.json").read_text())


def check_layouts(scn, model_config: dict, problems: Problems, *, key: str = "model") -> None:
    """Every layout the scenario declares against the model's dimensions and the devices."""
    src = str(scn.path)
    for backend, layout in scn.backends.items():
        world = 1
        for dim, size in layout.items():
            world *= size
        if backend == "megatron":
            tp, pp = layout.get("tp", 1), layout.get("pp", 1)
            try:
                spec = hf_model_spec(model_config)
            except InputError as e:
                problems.add(f"the megatron backend cannot run the {key} "
                             f"{Path(getattr(scn, key)) / 'config.json'}: {e.key}: {_bare(e)}",
                             source=src, key="backends.megatron")
                spec = None
            if spec is not None:
                try:
                    check_layout(spec, tp=tp, pp=pp)
                except InputError as e:
                    dim = "pp" if e.key in ("num_hidden_layers", "tie_word_embeddings") else "tp"
                    problems.add(f"{dim}={layout.get(dim, 1)} does not fit the {key} "
                                 f"{Path(getattr(scn, key)) / 'config.json'}: {_bare(e)}",
                                 source=src, key=f"backends.megatron.{dim}")
        if scn.device == "cuda" and world > 1:
            n = torch.cuda.device_count() if torch.cuda.is_available() else 0
            if n < world:
                problems.add(f"the {backend} layout {layout} needs {world} CUDA devices, "
                             f"{n} visible", source=src, key=f"backends.{backend}")


def _bare(e: InputError) -> str:
    """An InputError's message without its "source: key: " prefix."""
    where = ": ".join(p for p in (e.source, e.key) if p)
    text = str(e)
    return text[len(where) + 2:] if where and text.startswith(where + ": ") else text
