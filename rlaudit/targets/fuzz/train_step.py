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
Hypothesis only generates; the first failure is shrunk here, greedily and within a bound
(:data:`MAX_SHRINKS` runs): the knobs back to their defaults (halves first), the rows back in
order, then groups dropped, each change kept while the same invariant still fails. The result is
written as an ordinary scenario (``<name>.yaml`` + ``<name>.safetensors``) that ``rlaudit run
--target X`` replays.

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
import yaml
from hypothesis import HealthCheck, Phase, Verbosity, assume, example, given, seed, settings
from hypothesis import strategies as st

from rlaudit.algo.advantages import ADV_ESTIMATORS
from rlaudit.algo.agg import AGG_MODES
from rlaudit.algo.kl import KL_ESTIMATORS
from rlaudit.algo.policy_loss import POLICY_LOSSES
from rlaudit.config import load_config
from rlaudit.data.batch import RolloutBatch
from rlaudit.data.io import save_rollout
from rlaudit.errors import InputError
from rlaudit.scenarios.spec import Scenario
from rlaudit.targets.contract.adapter import adapter_name, supported_names, supports
from rlaudit.targets.fuzz.findings import CheckOutcome, Finding, found_name
from rlaudit.targets.fuzz.strategies import default_first
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
#: a prompt group of the built-in rollout is dropped with this probability (each kept group
#: makes more knobs visible: the filter needs a group with spread and one without)
DROP_GROUP = 0.25
#: training runs the greedy shrink may spend
MAX_SHRINKS = 12
#: invariants that read only the base run (no extra variant: one example = three runs)
INVARIANTS = ["backend-parity", "no-input-mutation", "reward-shaping", "rollout-parity",
              "sanity-bounds", "distributed-health"]
#: fixed part of every example's config (see the module docstring)
BASE = {
    "actor": {"optim": {"name": "sgd", "lr": 0.5}, "kl_loss_coef": 0.1},
    "algorithm": {"kl_coef": 0.1},
    "rollout": {"n": builtin.N, "response_length": builtin.MAX_NEW_TOKENS,
                "temperature": builtin.TEMPERATURE},
    "reward": {"overlong_buffer": {"len": 2, "penalty_factor": 1.0}},
    "data": {"train_batch_size": builtin.PROMPTS},
    "trainer": {"dtype": "float64", "seed": builtin.SEED},
}
#: scores >= this are 1, else 0, under the "accuracy" score knob (one group then has no spread)
ACCURACY_AT = 0.9
#: std of the shift of the sampling log-probs under the "stale" mismatch knob: per-token
#: log-ratios of O(0.5), sequence weights far past the truncation threshold 2
MISMATCH = 0.5


def knobs(adapter) -> dict[str, list]:
    """Dotted config key (or a pseudo key) -> values, the default first; names restricted to
    what the adapter declares it implements."""
    def names(attr, registry, default):
        return default_first(supported_names(adapter, attr, registry), default, registry)

    kls = names("kl_estimators", KL_ESTIMATORS, "low_var_kl")
    return {
        "steps": [1, 2],
        "actor.ppo_epochs": [1, 2],
        "actor.ppo_mini_batch_size": [4, 1],
        "actor.ppo_micro_batch_size_per_gpu": [2, 1, 4],
        "actor.use_dynamic_bsz": [False, True],
        "actor.loss_mode": names("loss_modes", POLICY_LOSSES, "vanilla"),
        "actor.loss_agg_mode": default_first(list(AGG_MODES), "token-mean"),
        "clip": [None, (0.2, 0.28)],
        "actor.calculate_entropy": [False, True],
        "actor.entropy_coeff": [0.0, 0.01],
        "actor.use_kl_loss": [False, True],
        "actor.kl_loss_type": kls,
        "algorithm.use_kl_in_reward": [False, True],
        "algorithm.kl_penalty": default_first(kls, "kl", KL_ESTIMATORS),
        "algorithm.adv_estimator": [e for e in names("advantage_estimators", ADV_ESTIMATORS,
                                                     "grpo") if e in ("grpo", "rloo")],
        "algorithm.norm_adv_by_std_in_grpo": [True, False],
        "algorithm.filter_groups.enable": [False, True],
        # what the filter reads: the rewards as shaped, the token scores summed, the rule score
        # as sampled (which the overlong penalty must not reach)
        "algorithm.filter_groups.metric": ["seq_final_reward", "seq_reward", "score"],
        "reward.overlong_buffer.enable": [False, True],
        # knobs whose every scenario value is the default cannot tell honoured from ignored (an
        # ignored-knob bug: a trainer dropping either stays green everywhere): 1.5 is above
        # 1 + every drawn clip_ratio_high, and reached by ratios of the second epoch
        "actor.clip_ratio_c": [3.0, 1.5],
        "reward.overlong_buffer.penalty_factor": [1.0, 0.5],
        "trainer.extra_padding_microbatches": [0, 1],
        "actor.context_parallel_size": [1, 2],
        "actor.rollout_correction.rollout_is": [None, "token", "sequence", "geometric"],
        "actor.rollout_correction.rollout_is_mode": ["truncate", "mask"],
        "scores": ["sampled", "accuracy"],
        "mismatch": ["none", "stale"],
    }


def example_strategy(adapter, rows: int, groups: int):
    """Knob values, which prompt groups of the built-in rollout are dropped (whole groups: every
    group keeps ``rollout.n`` rows, which trainers laying a batch out as prompts x n need) and
    the order of the rows (a group's rows scattered)."""
    table = knobs(adapter)

    @st.composite
    def example(draw):
        values = {k: draw(st.sampled_from(v)) for k, v in table.items()
                  if v and k not in DRAWN_LAST}
        drop = [draw(st.integers(0, int(1 / DROP_GROUP) - 1)) == 1 for _ in range(groups)]
        if all(drop):                   # nothing left to train on: keep every group instead
            drop = [False] * groups
        order = draw(st.permutations(list(range(rows))))
        values.update({k: draw(st.sampled_from(table[k])) for k in DRAWN_LAST if table.get(k)})
        return {"knobs": {k: values[k] for k in table if k in values}, "drop": drop,
                "order": order}
    return example()


#: knobs added after the budget was measured (benchmarks/fuzz_broken.py), drawn after the rest
#: so that every other part of an example is drawn as before
DRAWN_LAST = ("algorithm.filter_groups.metric", "actor.clip_ratio_c",
              "reward.overlong_buffer.penalty_factor")


def default_example(table: dict, rows: int, groups: int) -> dict:
    """The first example (Hypothesis' explicit phase): every knob at its default, every row of
    the built-in rollout in order."""
    return {"knobs": {k: v[0] for k, v in table.items() if v}, "drop": [False] * groups,
            "order": list(range(rows))}


def config_of(values: dict) -> tuple[dict, int]:
    """(config dict, steps) of knob values."""
    cfg = yaml.safe_load(yaml.safe_dump(BASE))
    for key, v in values.items():
        if key in ("steps", "scores", "mismatch") or v is None:
            continue
        if key == "clip":
            cfg["actor"]["clip_ratio_low"], cfg["actor"]["clip_ratio_high"] = v
            continue
        node = cfg
        *parents, leaf = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = v
    if values.get("actor.use_dynamic_bsz"):
        cfg["actor"]["ppo_max_token_len_per_gpu"] = 24
    return cfg, int(values.get("steps", 1))


def invariants_of(ex: dict) -> list[str]:
    """:data:`INVARIANTS`, without rollout-parity for a stale rollout (its sampling log-probs
    are not the policy's by construction)."""
    if ex["knobs"].get("mismatch") == "stale":
        return [i for i in INVARIANTS if i != "rollout-parity"]
    return list(INVARIANTS)


def config_for(ex: dict, raw: RolloutBatch) -> tuple[dict, int]:
    """:func:`config_of` with ``rollout.n`` and ``data.train_batch_size`` as the drawn rows have
    them (trainers that lay a batch out as prompts x n need them to agree; ragged groups keep
    the largest size)."""
    cfg, steps = config_of(ex["knobs"])
    _, sizes = torch.unique(raw["uid"], return_counts=True)
    cfg["rollout"]["n"] = int(sizes.max())
    cfg["data"]["train_batch_size"] = int(len(sizes))
    return cfg, steps


def kept_rows(batch: RolloutBatch, ex: dict) -> list[int]:
    """Rows of the built-in rollout an example keeps, in its order."""
    groups = list(dict.fromkeys(batch["uid"].tolist()))
    dropped = {g for g, d in zip(groups, ex["drop"]) if d}
    uid = batch["uid"].tolist()
    return [i for i in ex["order"] if uid[i] not in dropped]


def rollout_of(batch: RolloutBatch, ex: dict) -> RolloutBatch | None:
    """The drawn geometry of the built-in rollout (None: fewer than two rows left)."""
    rows = kept_rows(batch, ex)
    if len(rows) < 2:
        return None
    out = batch.select(rows)
    if ex["knobs"].get("scores") == "accuracy":
        out = out.with_fields(scores=(out["scores"] >= ACCURACY_AT).double())
    if ex["knobs"].get("mismatch") == "stale":
        out = stale(out)
    return out


def stale(batch: RolloutBatch) -> RolloutBatch:
    """The rollout as if sampled by an older policy: its sampling log-probs moved by
    ``MISMATCH * N(0, 1)`` (fixed seed) on response tokens, so rollout importance weights are
    far from 1 and truncation acts (rollout-parity is not checked on such a rollout)."""
    g = torch.Generator().manual_seed(0)
    lp = batch["rollout_log_probs"]
    noise = MISMATCH * torch.randn(lp.shape, generator=g, dtype=torch.float64).to(lp.dtype)
    in_resp = torch.arange(lp.shape[1]).unsqueeze(0) < batch["response_lengths"].unsqueeze(1)
    return batch.with_fields(rollout_log_probs=torch.where(in_resp, (lp + noise).clamp(max=0.0),
                                                           lp))


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
        raw = rollout_of(self.batch, ex)
        if raw is None:
            return None
        path = self.tmp / f"example-{self.runs}.safetensors"
        save_rollout(raw, path)
        scn = self.scenario(ex, path, raw)
        if scn is None or not supports(self.adapter, scn.config)[0]:
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
                    rng_seed: int = 0, write: bool = True, scenarios_dir="scenarios") -> None:
    """Run-level fuzzing; appends an outcome (and a finding) for ``train_step`` to ``report``."""
    budget = DEFAULT_RUN_BUDGET if budget is None else budget
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 0:
        raise InputError(f"expected an integer >= 0, got {budget!r}", key="--run-budget")
    check = "train_step:run-level"
    if budget == 0:
        report.outcomes.append(CheckOutcome(check, "n/a", note="--run-budget 0"))
        return
    probe = RunProbe(adapter, scenarios_dir)
    table = knobs(adapter)
    state = {"n": 0, "hit": None}

    def body(ex):
        bad = probe.run(ex)
        assume(bad is not None)
        state["n"] += 1
        if bad:
            state["hit"] = (ex, bad)
            raise _Found()

    test = settings(max_examples=budget, database=database, deadline=None,
                    report_multiple_bugs=False, verbosity=Verbosity.quiet,
                    suppress_health_check=list(HealthCheck),
                    phases=(Phase.explicit, Phase.reuse, Phase.generate))(
        seed(rng_seed)(example(default_example(table, *probe.geometry))(
            given(example_strategy(adapter, *probe.geometry))(body))))
    test._hypothesis_internal_database_key = hashlib.sha256(
        f"rlaudit-fuzz-run:5:{probe.name}".encode()).digest()
    t0 = time.perf_counter()
    try:
        test()
    except _Found:
        pass
    try:
        _finish(probe, report, state, table, check=check, t0=t0, budget=budget, spec=spec,
                found_dir=found_dir, rng_seed=rng_seed, write=write)
    finally:
        shutil.rmtree(probe.tmp, ignore_errors=True)


def _finish(probe, report, state, table, *, check, t0, budget, spec, found_dir, rng_seed,
            write) -> None:
    if state["hit"] is None:
        report.outcomes.append(CheckOutcome(check, "clean", state["n"],
                                            time.perf_counter() - t0,
                                            note=f"{probe.runs} scenario runs"))
        return
    ex, bad = state["hit"]
    want = next(iter(bad))
    ex, bad = _shrink(probe, ex, bad, want, table)
    message = f"{want}: {bad[want]}"
    seconds = time.perf_counter() - t0
    path = None
    if write:
        path = save_run_case(Path(found_dir), found_name(probe.name, "train_step"), probe, ex,
                             target=spec, message=message,
                             found_by={"command": "rlaudit fuzz", "run_budget": budget,
                                       "seed": rng_seed, "examples_until_found": state["n"],
                                       "runs": probe.runs})
    report.outcomes.append(CheckOutcome(check, "found", state["n"], seconds,
                                        note=f"{probe.runs} scenario runs"))
    report.findings.append(Finding(check, message, None, path, state["n"], seconds))


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


__all__ = ["DEFAULT_RUN_BUDGET", "INVARIANTS", "fuzz_train_step", "knobs"]
