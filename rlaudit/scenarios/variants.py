"""A scenario's variants -- the baseline run plus every invariant's extra runs -- and whether
their replay is possible and not degenerate.

Degenerate data is an input error, never a vacuous pass: a batch with no rows or no trainable
token (after the DAPO group filter), a mini-batch without a trainable token, a cut the backends
cannot make (mini-batch rows that do not divide the batch, a DP size that does not divide a
mini-batch, a row longer than the token budget), and an invariant left with nothing to compare
(all its runs identical in rows, steps, config and effective micro-batch cut).
:func:`replayable_variants` checks all of it; the validation pass of an invocation
(rlaudit.scenarios.validate) and the engine both run it, so a direct ``run_scenario`` call gets it
as well.
"""

from __future__ import annotations

import json

from rlaudit.backends.base import Variant
from rlaudit.config import replayed_dict
from rlaudit.data.batching import (plan_microbatches_by_count, plan_microbatches_by_tokens,
                                   plan_minibatches)
from rlaudit.data.io import rollout_sha256
from rlaudit.dicts import flatten
from rlaudit.errors import InputError, Problems, raise_problems
from rlaudit.scenarios.invariants import INVARIANTS
from rlaudit.scenarios.invariants.base import base_variant
from rlaudit.scenarios.spec import Scenario

#: config keys that only decide how a mini-batch is cut into micro-batches: two runs that differ
#: only there, and cut every mini-batch the same way, compare nothing
CUT_KEYS = ("actor.ppo_micro_batch_size_per_gpu", "actor.use_dynamic_bsz",
            "actor.ppo_max_token_len_per_gpu", "critic.ppo_micro_batch_size_per_gpu")


def build_variants(scn: Scenario, batch) -> list[Variant]:
    """The baseline plus every invariant's extra runs, deduplicated by name."""
    variants = {"base": base_variant(scn, batch, "base", steps=scn.steps)}
    for name in scn.invariants:
        for v in INVARIANTS.get(name).variants(scn, batch):
            variants.setdefault(v.name, v)
    return list(variants.values())


def check_sampling_matches(scn: Scenario, batch) -> None:
    """The trainer recomputes log-probs at ``config.rollout.temperature``; a rollout sampled at
    another temperature would make every log-prob comparison with the sampler fail for a reason
    that is the scenario's, not the trainer's. Rollouts without sampling metadata are accepted."""
    sampled = (batch.meta.get("sampling") or {}).get("temperature")
    want = scn.config.rollout.temperature
    if sampled is None or float(sampled) == 0.0:  # greedy: vLLM reports temperature-1 log-probs
        return
    if abs(float(sampled) - float(want)) > 1e-12:
        raise InputError(f"is {want}, but the rollout {scn.rollout.name} was sampled at temperature "
                         f"{sampled} (its meta.sampling.temperature); set config.rollout.temperature "
                         f"to {sampled}", source=str(scn.path), key="config.rollout.temperature")


def replayable_variants(scn, batch) -> list:
    """The scenario's variants (:func:`build_variants`) for ``batch`` (the
    rollout after the DAPO group filter), after checking that the replay is neither impossible
    nor degenerate (:func:`replay_problems`); raises every problem found."""
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
    cfg = {k: val for k, val in flatten(replayed_dict(v.config)).items() if k not in CUT_KEYS}
    return (rollout_sha256(v.batch), v.steps, json.dumps(cfg, sort_keys=True, default=str), cut)


def _why_identical(scn, batch, cuts, names) -> str:
    cut = cuts.get(names[0]) or ()
    if cut and all(len(mb[0]) == 1 and len(mb[0][0]) == 1 for mb in cut):
        return (" (every micro-batch cut is the same because each mini-batch has one row: "
                "actor.ppo_mini_batch_size x rollout.n = 1)")
    return ""
