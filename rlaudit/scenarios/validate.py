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
  sampling temperature against the config, and :func:`replayable_variants`;
- its golden file when there is one (:func:`rlaudit.scenarios.golden.read_golden`).

:func:`replayable_variants` is the part that needs the scenario's variants; the engine runs it too,
so a direct ``run_scenario`` call gets it as well. Degenerate data is an input error, never a
vacuous pass: a batch with no rows or no trainable token (after the DAPO group filter), a
mini-batch without a trainable token, a cut the backends cannot make (mini-batch rows that do not
divide the batch, a DP size that does not divide a mini-batch, a row longer than the token
budget), and an invariant left with nothing to compare (all its runs identical in rows, steps,
config and effective micro-batch cut).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from rlaudit.errors import InputError, InputErrors, raise_problems
from rlaudit.scenarios.bounds import duplicate_names

#: config keys that only decide how a mini-batch is cut into micro-batches: two runs that differ
#: only there, and cut every mini-batch the same way, compare nothing
CUT_KEYS = ("actor.ppo_micro_batch_size_per_gpu", "actor.use_dynamic_bsz",
            "actor.ppo_max_token_len_per_gpu", "critic.ppo_micro_batch_size_per_gpu")
#: header of the combined message
HEADER = "input problems; nothing was run"


@dataclass
class Problems:
    """Collects InputErrors; identical ones (a rollout shared by scenarios) are kept once."""

    items: list[InputError] = field(default_factory=list)

    def add(self, message: str, *, source: str | None, key: str | None) -> None:
        self.take(InputError(message, source=source, key=key))

    def take(self, err: InputError) -> None:
        if str(err) not in {str(p) for p in self.items}:
            self.items.append(err)

    def attempt(self, fn: Callable, *args, wrap: tuple[str, str] | None = None, **kw):
        """``fn(*args, **kw)``, or None with its InputError recorded (``wrap=(source, key)``:
        recorded under that file and key, the original message kept)."""
        try:
            return fn(*args, **kw)
        except InputError as e:
            if wrap is None:
                self.take(e)
            else:
                self.add(str(e), source=wrap[0], key=wrap[1])
            return None


# ---- the invocation ---------------------------------------------------------------------------

def validate_invocation(paths: list[Path], *, backends: list[str] | None = None,
                        golden_dir: str | Path | None = None,
                        device: str | None = None) -> list:
    """Load and check every scenario of an invocation (see the module docstring). Returns the
    scenarios (with ``device`` applied); raises the InputError(s) found, all together."""
    from rlaudit.backends.registry import backend_names
    from rlaudit.scenarios.spec import load_scenario

    from rlaudit.update import forward_memo

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
    from rlaudit.data.io import load_rollout
    from rlaudit.scenarios.engine import check_sampling_matches
    from rlaudit.update.step import select_groups

    cache = {} if cache is None else cache
    src = str(scn.path)
    for key, model in (("model", scn.model), ("ref_model", scn.ref_model)):
        if model is None:
            continue
        cfg = _cached(cache, ("model", str(model)), problems, _check_model, model,
                      wrap=(src, key))
        if cfg is not None:
            check_layouts(scn, cfg, problems, key=key)
    batch = _cached(cache, ("rollout", str(scn.rollout)), problems, load_rollout, scn.rollout)
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
        from rlaudit.scenarios.golden import golden_path, read_golden
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
    import safetensors

    from rlaudit.model.load import TOKENIZER_FILES, snapshot_id, weight_files
    from rlaudit.model.snapshot_check import check_weights_hash
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
            from rlaudit.backends.megatron.model import check_layout, hf_model_spec
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
            import torch
            n = torch.cuda.device_count() if torch.cuda.is_available() else 0
            if n < world:
                problems.add(f"the {backend} layout {layout} needs {world} CUDA devices, "
                             f"{n} visible", source=src, key=f"backends.{backend}")


def _bare(e: InputError) -> str:
    """An InputError's message without its "source: key: " prefix."""
    where = ": ".join(p for p in (e.source, e.key) if p)
    text = str(e)
    return text[len(where) + 2:] if where and text.startswith(where + ": ") else text


# ---- degenerate data and cuts -----------------------------------------------------------------

def replayable_variants(scn, batch) -> list:
    """The scenario's variants (rlaudit.scenarios.engine.build_variants) for ``batch`` (the
    rollout after the DAPO group filter), after checking that the replay is neither impossible
    nor degenerate (:func:`replay_problems`); raises every problem found."""
    from rlaudit.scenarios.engine import build_variants
    if not len(batch):
        fg = scn.config.algorithm.filter_groups
        if fg.enable:
            raise InputError(f"the DAPO group filter (metric {fg.metric}) keeps no group of "
                             f"{scn.rollout}: every group's values are identical, nothing is "
                             "left to replay", source=str(scn.path),
                             key="config.algorithm.filter_groups.enable")
        raise InputError(f"no rows to replay from {scn.rollout}", source=str(scn.path),
                         key="rollout")
    variants = build_variants(scn, batch)
    raise_problems(replay_problems(scn, batch, variants))
    return variants


def replay_problems(scn, batch, variants) -> list[InputError]:
    """What makes a scenario's replay degenerate or impossible (see the module docstring)."""
    from rlaudit.scenarios.invariants import INVARIANTS

    src = str(scn.path)
    out = Problems()
    if len(batch) and not batch.num_tokens():
        out.add("no token has response_mask True: nothing to train on, every check would pass "
                "vacuously", source=str(scn.rollout), key="response_mask")
        return out.items
    cuts: dict[str, tuple] = {}
    found: dict[tuple[str, str], list[str]] = {}
    for v in variants:
        cut, issues = _cut(scn, v)
        cuts[v.name] = cut
        for key, message in issues:
            found.setdefault((key, message), []).append(v.name)
    for (key, message), names in found.items():
        out.add(f"{message} (run(s) {', '.join(names)})", source=src, key=key)
    if out.items:
        return out.items
    sigs = {v.name: _signature(v, cuts[v.name]) for v in variants}
    for i, name in enumerate(scn.invariants):
        own = [v.name for v in INVARIANTS.get(name).variants(scn, batch)]
        if len(own) >= 2 and len({sigs[n] for n in own if n in sigs}) == 1:
            out.add(f"{name} has nothing to compare: its runs {', '.join(own)} replay "
                    f"identical batches (the same rows in the same order) with the same config, "
                    f"steps and micro-batch cut"
                    f"{_why_identical(scn, batch, cuts, own)}", source=src,
                    key=f"invariants[{i}]")
    return out.items


def _cut(scn, v) -> tuple[tuple, list[tuple[str, str]]]:
    """(the effective cut of variant ``v``: per epoch, per mini-batch, its micro-batches as row
    tuples, actor then critic when one is used; problems as (key, message))."""
    from rlaudit.data.batching import (plan_microbatches_by_count, plan_microbatches_by_tokens,
                                       plan_minibatches)
    cfg, batch = v.config, v.batch
    act, rows = cfg.actor, len(batch)
    issues: list[tuple[str, str]] = []
    mb_rows = min(act.ppo_mini_batch_size * cfg.rollout.n, rows)
    if rows % mb_rows:
        issues.append(("config.actor.ppo_mini_batch_size",
                       f"{act.ppo_mini_batch_size} prompt(s) x rollout.n {cfg.rollout.n} = "
                       f"{mb_rows} rows per mini-batch do not divide the {rows} rows replayed"))
        return (), issues
    for backend, layout in scn.backends.items():
        dp = layout.get("dp", 1)
        if mb_rows % dp:
            issues.append((f"backends.{backend}.dp",
                           f"dp={dp} does not divide the {mb_rows} rows of a mini-batch"))
    lengths = batch.sequence_lengths()
    if act.use_dynamic_bsz and int(lengths.max()) > act.ppo_max_token_len_per_gpu:
        row = int(lengths.argmax())
        issues.append(("config.actor.ppo_max_token_len_per_gpu",
                       f"row {row} has {int(lengths[row])} tokens (prompt + response), more than "
                       f"the micro-batch token budget {act.ppo_max_token_len_per_gpu}"))
    if issues:
        return (), issues
    mask_tokens = batch.mask.sum(1)
    cut = []
    for epoch in range(act.ppo_epochs):
        for k, mb in enumerate(plan_minibatches(rows, mb_rows, shuffle=act.shuffle,
                                                seed=cfg.trainer.seed + epoch)):
            if not int(mask_tokens[mb].sum()):
                issues.append(("config.actor.ppo_mini_batch_size",
                               f"mini-batch {k} of epoch {epoch} (rows {mb.tolist()}) has no "
                               "token with response_mask True: its optimizer step trains on "
                               "nothing and every check of it compares nothing"))
            pieces = []
            sizes = (act.ppo_micro_batch_size_per_gpu,) + (
                (cfg.critic.ppo_micro_batch_size_per_gpu,) if cfg.use_critic else ())
            for size in sizes:
                plan = (plan_microbatches_by_tokens(lengths[mb], act.ppo_max_token_len_per_gpu)
                        if act.use_dynamic_bsz else plan_microbatches_by_count(len(mb), size))
                pieces.append(tuple(tuple(mb[p].tolist()) for p in plan))
            cut.append(tuple(pieces))
    return tuple(cut), issues


def _signature(v, cut) -> tuple:
    from rlaudit.config import flatten, replayed_dict
    from rlaudit.data.io import rollout_sha256
    cfg = {k: val for k, val in flatten(replayed_dict(v.config)).items() if k not in CUT_KEYS}
    return (rollout_sha256(v.batch), v.steps, json.dumps(cfg, sort_keys=True, default=str), cut)


def _why_identical(scn, batch, cuts, names) -> str:
    cut = cuts.get(names[0]) or ()
    if cut and all(len(mb[0]) == 1 and len(mb[0][0]) == 1 for mb in cut):
        return (" (every micro-batch cut is the same because each mini-batch has one row: "
                "actor.ppo_mini_batch_size x rollout.n = 1)")
    return ""


# ---- adapters (rlaudit run --target) ----------------------------------------------------------

def stage_contract() -> dict[str, tuple[list[str], list[str]]]:
    """stage -> (positional parameters, required keyword parameters), read from the contract in
    :mod:`rlaudit.targets.adapter`'s docstring (its "Stages" block is the one place they are
    written down); parameters with a default there are optional."""
    import re

    from rlaudit.targets import adapter
    block = adapter.__doc__.split("Stages (each optional)::", 1)[1].split("\n\n", 2)[1]
    out = {}
    for name, params in re.findall(r"^    (\w+)\((.*?)\)\s*(?:\n\s*)?->", block, re.M | re.S):
        positional, keyword, star = [], [], False
        for p in (x.strip() for x in params.replace("\n", " ").split(",")):
            if p == "*":
                star = True
            elif p and "=" not in p:
                (keyword if star else positional).append(p)
        out[name] = (positional, keyword)
    return out


def adapter_problems(adapter: object, source: str) -> list[InputError]:
    """Each provided stage must accept the contract's required arguments (positional ones by
    position, the rest by keyword): a stage that cannot take them is found here, not as a
    TypeError in the middle of the checks. Parameters of the stage beyond the contract are not
    judged (the checks pass some optional ones, e.g. ``response_lengths``, when accepted)."""
    import inspect
    problems = []
    for stage, (positional, keyword) in stage_contract().items():
        fn = getattr(adapter, stage, None)
        if fn is None:
            continue
        if not callable(fn):
            problems.append(InputError(f"expected a method, got {type(fn).__name__}",
                                       source=source, key=stage))
            continue
        try:
            sig = inspect.signature(fn)
        except (TypeError, ValueError):
            continue  # a builtin or C callable: nothing to check up front
        try:
            sig.bind_partial(*positional, **{k: None for k in keyword})
        except TypeError as e:
            call = ", ".join([*positional, "*", *keyword]) if keyword else ", ".join(positional)
            problems.append(InputError(f"cannot be called as the contract calls it, "
                                       f"{stage}({call}): {e} (its signature: {stage}{sig})",
                                       source=source, key=stage))
    return problems


def validate_target(spec: str, paths: list[Path]) -> object:
    """``rlaudit run --target``: load the adapter (``module:Attr`` or a peer's name), check its
    stages' signatures and every named scenario's inputs; return the adapter or raise every
    problem together."""
    from rlaudit.targets.adapter import load_adapter
    from rlaudit.targets.found import is_stage_case, load_stage_case
    adapter = load_adapter(spec)
    problems = Problems()
    for p in adapter_problems(adapter, spec):
        problems.take(p)
    # stage cases written by `rlaudit fuzz` (scenarios/found/) are read as such, not as scenarios
    for path in [p for p in paths if is_stage_case(p)]:
        try:
            load_stage_case(path)
        except InputError as e:
            problems.take(e)
    paths = [p for p in paths if not is_stage_case(p)]
    try:
        validate_invocation(paths)
    except InputErrors as e:
        for p in e.problems:
            problems.take(p)
    except InputError as e:
        problems.take(e)
    raise_problems(problems.items, header=HEADER)
    return adapter
