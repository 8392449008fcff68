"""Run-level fuzzing of an adapter's ``train_step`` (part of ``rlaudit fuzz``).

Each example is a whole scenario: Hypothesis draws a training configuration (every knob of
:func:`knobs`, the first value of each being rlaudit's default, and the first example all defaults)
and a version of the built-in rollout: prompt groups dropped (whole groups: each keeps its
``rollout.n`` rows, as generation produces them), rows reordered so a group's rows are scattered,
rule scores as sampled or as 0/1 accuracy, sampling log-probs as recorded or stale (:func:`stale`).
The scenario is replayed on the target and on the reference backend through
:func:`rlaudit.targets.run.runner.run_target_scenario` (the target's declared precision, noise
floor, metric reduction, differences, ``filters_groups`` and ``supports`` apply as in ``rlaudit
run``) with the invariants that need no variant beyond the base run (:data:`INVARIANTS`). Examples
the adapter does not support (``supports``, ``NotImplementedError``) or the reference rejects for
the drawn rows are discarded, not counted as passed.

An example costs two or three training runs (target, reference, and the reference's noise-floor
replay when a check does not pass without it), so
Hypothesis only generates. The search goes on after a finding, up to the budget: each distinct
finding (a failing invariant, by name) is kept with the first example that showed it, and each
is shrunk here, greedily and within a bound (:data:`MAX_SHRINKS` runs): the knobs back to their
defaults (halves first), the rows back in order, then groups dropped, each change kept while the
same invariant still fails. Each is written as an ordinary scenario (``<name>.yaml`` +
``<name>.safetensors``) that ``rlaudit run --target X`` replays. The outcome says how many drawn
examples the target declined (``supports``, ``NotImplementedError``); knob values the target
declines on their own (every other knob at its default) are not drawn (:func:`accepted`).

Held fixed, as the built-in scenario does (so that every term a knob switches on moves results
visibly): the tiny Qwen2 snapshot, the tiny Llama as reference policy, float64, SGD with lr 0.5,
KL coefficients 0.1, the rollout's temperature 0.7.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch
from hypothesis import HealthCheck, Phase, Verbosity, assume, example, given, seed, settings

from rlaudit.config import load_config
from rlaudit.data.batch import RolloutBatch
from rlaudit.data.io import save_rollout
from rlaudit.errors import InputError
from rlaudit.scenarios.spec import Scenario
from rlaudit.targets.contract.adapter import adapter_name, supports
from rlaudit.targets.fuzz.examples import (DRAWN_LAST, INVARIANTS, accepted, config_for,
                                           config_of, default_example, example_strategy,
                                           example_strategy_of, invariants_of, kept_rows, knobs,
                                           rollout_of)
from rlaudit.targets.fuzz.findings import CheckOutcome, Finding, found_name, slug
from rlaudit.targets.inputs import builtin
from rlaudit.targets.run.found import write_yaml
from rlaudit.targets.run.runner import run_target_scenario
from rlaudit.update.step import select_groups
from rlaudit.verdict.result import ERROR, FAIL

#: examples per run-level fuzz (``--run-budget``; the default example first). The rarest
#: conditions among the train_step bugs of tests/targets/broken_adapters.py (a self-filtering
#: trainer's misalignment: the DAPO filter on, 0/1 scores, no overlong penalty, both groups
#: kept; a wrong sequence-level IS weight: level sequence on a stale rollout) hold in ~10% of
#: the drawn examples (measured over 2000), so 79 random examples miss one with probability
#: ~0.03%; benchmarks/fuzz_broken.py measures the examples each bug takes (seeds 0-3: 1 to 68)
DEFAULT_RUN_BUDGET = 80
#: training runs the greedy shrink may spend
MAX_SHRINKS = 12


class _Found(Exception):
    pass


class RunProbe:
    """Runs examples as scenarios against the target (one temporary rollout file each)."""

    def __init__(self, adapter, scenarios_dir):
        self.adapter = adapter
        self.name = adapter_name(adapter)
        self.model = builtin.tiny_model_path(scenarios_dir)
        self.ref = builtin.tiny_model_path(scenarios_dir, "llama")
        self.batch = builtin.rollout(self.model)
        #: (rows, prompt groups) of the built-in rollout
        self.geometry = (len(self.batch), int(torch.unique(self.batch["uid"]).numel()))
        self.tmp = Path(tempfile.mkdtemp(prefix="rlaudit-fuzz-"))
        self.runs = 0
        #: examples drawn, and those the target declined (supports, NotImplementedError)
        self.drawn = 0
        self.declined = 0

    def scenario(self, ex: dict, rollout_path: Path, raw: RolloutBatch) -> Scenario | None:
        cfg_dict, steps = config_for(ex, raw)
        try:
            cfg = load_config(cfg_dict, source="rlaudit fuzz")
        except InputError:
            return None
        return Scenario(name="fuzz", path=Path("<rlaudit fuzz>"), description="",
                        model=self.model, ref_model=self.ref, rollout=rollout_path, config=cfg,
                        backends={"reference": {}}, invariants=invariants_of(ex), steps=steps,
                        dtype="float64", tolerances={"default": builtin.TOLERANCE},
                        tags=["fuzz"])

    def run(self, ex: dict):
        """(failing invariants of the target, their messages) or None when the example does
        not apply (unsupported config, nothing left after the group filter)."""
        self.drawn += 1
        raw = rollout_of(self.batch, ex)
        if raw is None:
            return None
        path = self.tmp / f"example-{self.runs}.safetensors"
        save_rollout(raw, path)
        scn = self.scenario(ex, path, raw)
        if scn is None:
            return None
        if not supports(self.adapter, scn.config)[0]:
            self.declined += 1
            return None
        batch = select_groups(raw, scn.config)[0]
        if len(batch) < 2:
            return None
        self.runs += 1
        try:
            res = run_target_scenario(self.adapter, scn, batch, invariants=scn.invariants,
                                      unfiltered=raw)
        except InputError:      # e.g. mini-batches that do not divide the drawn rows
            return None
        if res.errors.get(self.name, "").startswith("NotImplementedError"):
            self.declined += 1
            return None         # the trainer says it does not support this input
        bad = {}
        for c in res.checks:
            if c.status in (FAIL, ERROR):
                who = "" if c.backend == self.name else f" [{c.backend}]"
                bad.setdefault(c.invariant + who, c.message)
        return bad


def _shrink(probe: RunProbe, ex: dict, bad: dict, want: str, table: dict) -> tuple[dict, dict]:
    """Greedy, bounded: knobs to defaults, rows in order, groups dropped; each change kept while
    ``want`` still fails. Returns the smallest failing example and its failures."""
    budget, last = MAX_SHRINKS, bad

    def still(candidate) -> bool:
        nonlocal budget, last
        if budget <= 0:
            return False
        budget -= 1
        got = probe.run(candidate)
        if got and want in got:
            last = got
            return True
        return False

    def reset(ex, keys):
        return {**ex, "knobs": {**ex["knobs"], **{k: table[k][0] for k in keys}}}

    changed = [k for k, v in table.items() if v and ex["knobs"].get(k) != v[0]]
    while len(changed) > 2:             # halves first: one needed knob costs ~log2 runs
        half = len(changed) // 2
        for part, rest in ((changed[:half], changed[half:]), (changed[half:], changed[:half])):
            if still(reset(ex, part)):
                ex, changed = reset(ex, part), rest
                break
        else:
            break
    for key in changed:
        if still(reset(ex, [key])):
            ex = reset(ex, [key])
    if ex["order"] != sorted(ex["order"]):
        cand = {**ex, "order": sorted(ex["order"])}
        if still(cand):
            ex = cand
    for i in range(len(ex["drop"])):        # whole groups dropped
        if not ex["drop"][i]:
            cand = {**ex, "drop": [d or j == i for j, d in enumerate(ex["drop"])]}
            if still(cand):
                ex = cand
    return ex, last


def fuzz_train_step(adapter, report, *, spec: str, budget: int | None, found_dir, database,
                    rng_seed: int = 0, write: bool = True, scenarios_dir="scenarios",
                    max_findings: int | None = None) -> None:
    """Run-level fuzzing; appends an outcome (and a finding per distinct failing invariant) for
    ``train_step`` to ``report``. ``max_findings``: stop drawing once that many distinct
    findings are in (None: go on to the budget)."""
    budget = DEFAULT_RUN_BUDGET if budget is None else budget
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 0:
        raise InputError(f"expected an integer >= 0, got {budget!r}", key="--run-budget")
    check = "train_step:run-level"
    if budget == 0:
        report.outcomes.append(CheckOutcome(check, "n/a", note="--run-budget 0"))
        return
    probe = RunProbe(adapter, scenarios_dir)
    table, not_drawn = accepted(adapter, knobs(adapter))
    state = {"n": 0, "hits": {}}

    def body(ex):
        bad = probe.run(ex)
        assume(bad is not None)
        state["n"] += 1
        for key in (bad or {}):
            if max_findings is None or len(state["hits"]) < max_findings:
                state["hits"].setdefault(key, (ex, bad, state["n"]))
        if max_findings is not None and len(state["hits"]) >= max_findings:
            raise _Found()

    test = settings(max_examples=budget, database=database, deadline=None,
                    report_multiple_bugs=False, verbosity=Verbosity.quiet,
                    suppress_health_check=list(HealthCheck),
                    phases=(Phase.explicit, Phase.reuse, Phase.generate))(
        seed(rng_seed)(example(default_example(table, *probe.geometry))(
            given(example_strategy_of(table, *probe.geometry))(body))))
    test._hypothesis_internal_database_key = hashlib.sha256(
        f"rlaudit-fuzz-run:5:{probe.name}".encode()).digest()
    t0 = time.perf_counter()
    try:
        test()
    except _Found:
        pass
    try:
        _finish(probe, report, state, table, check=check, t0=t0, budget=budget, spec=spec,
                found_dir=found_dir, rng_seed=rng_seed, write=write, not_drawn=not_drawn)
    finally:
        shutil.rmtree(probe.tmp, ignore_errors=True)


def declined_note(probe: RunProbe, not_drawn: list[str]) -> str:
    """The outcome's note: scenario runs, the share of drawn examples the target declined, and
    the knob values not drawn because it declines them on their own."""
    share = probe.declined / probe.drawn if probe.drawn else 0.0
    note = (f"{probe.runs} scenario runs; {probe.declined} of {probe.drawn} drawn examples "
            f"declined by the target ({share:.0%})")
    if not_drawn:
        note += f"; not drawn (declined alone): {', '.join(not_drawn)}"
    return note


def _finish(probe, report, state, table, *, check, t0, budget, spec, found_dir, rng_seed,
            write, not_drawn) -> None:
    note = declined_note(probe, not_drawn)      # the search's draws, before any shrinking run
    if not state["hits"]:
        report.outcomes.append(CheckOutcome(check, "clean", state["n"],
                                            time.perf_counter() - t0, note=note))
        return
    first = min(at for _, _, at in state["hits"].values())
    for want, (ex, bad, at) in state["hits"].items():
        ex, bad = _shrink(probe, ex, bad, want, table)
        message = f"{want}: {bad[want]}"
        path = None
        if write:
            name = found_name(probe.name, f"train_step:{slug(want)}")
            path = save_run_case(Path(found_dir), name, probe, ex, target=spec, message=message,
                                 found_by={"command": "rlaudit fuzz", "run_budget": budget,
                                           "seed": rng_seed, "examples_until_found": at,
                                           "runs": probe.runs})
        report.findings.append(Finding(check, message, None, path, at,
                                       time.perf_counter() - t0))
    report.outcomes.append(CheckOutcome(
        check, "found", first, time.perf_counter() - t0,
        note=f"{len(state['hits'])} distinct finding(s) in {state['n']} examples; {note}"))


def save_run_case(directory: Path, name: str, probe: RunProbe, ex: dict, *, target: str,
                  message: str, found_by: dict) -> Path:
    """An ordinary scenario file plus its rollout: ``rlaudit run --target X <path>``."""
    directory.mkdir(parents=True, exist_ok=True)
    raw = rollout_of(probe.batch, ex)
    save_rollout(raw, directory / f"{name}.safetensors")
    cfg, steps = config_for(ex, raw)
    changed = {k: (list(v) if isinstance(v, tuple) else v) for k, v in ex["knobs"].items()
               if v != knobs(probe.adapter)[k][0]}
    doc = {
        "description": (f"Found by `rlaudit fuzz` on {target}: {message[:400]} | knobs off "
                        f"their defaults: {changed or 'none'}; rows of the built-in rollout "
                        f"kept, in order: {kept_rows(probe.batch, ex)}. "
                        f"Replay: rlaudit run --target {target} {directory / (name + '.yaml')}"),
        "model": os.path.relpath(probe.model, directory),
        "ref_model": os.path.relpath(probe.ref, directory),
        "rollout": f"{name}.safetensors", "steps": steps, "dtype": "float64",
        "config": cfg, "backends": {"reference": {}}, "invariants": invariants_of(ex),
        "tolerances": {"default": {"rtol": builtin.TOLERANCE.rtol,
                                   "atol": builtin.TOLERANCE.atol}},
        "tags": ["found", "fuzz"],
    }
    return write_yaml(directory / f"{name}.yaml", doc, header=f"# found_by: {found_by}\n")


__all__ = ["DEFAULT_RUN_BUDGET", "DRAWN_LAST", "INVARIANTS", "config_of", "example_strategy",
           "fuzz_train_step", "knobs"]
