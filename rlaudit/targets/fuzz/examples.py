"""The examples of the run-level fuzz (:mod:`rlaudit.targets.fuzz.train_step`): the knob table
(every knob a drawn scenario varies, rlaudit's default first), the drawing of an example (knob
values, prompt groups dropped, rows reordered), and the scenario config and rollout it makes.
"""

from __future__ import annotations

import torch
import yaml
from hypothesis import strategies as st

from rlaudit.algo.advantages import ADV_ESTIMATORS
from rlaudit.algo.agg import AGG_MODES
from rlaudit.algo.kl import KL_ESTIMATORS
from rlaudit.algo.policy_loss import POLICY_LOSSES
from rlaudit.config import load_config
from rlaudit.data.batch import RolloutBatch
from rlaudit.errors import InputError
from rlaudit.targets.contract.adapter import supported_names, supports
from rlaudit.targets.fuzz.strategies import default_first
from rlaudit.targets.inputs import builtin

#: a prompt group of the built-in rollout is dropped with this probability (each kept group
#: makes more knobs visible: the filter needs a group with spread and one without)
DROP_GROUP = 0.25
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


def accepted(adapter, table: dict) -> tuple[dict, list[str]]:
    """``table`` without the values ``adapter`` declines on their own (the knob set to the value,
    every other knob at its default: ``supports``), so draws go to what it runs; and the values
    left out, as "knob=value". A default it declines is kept (its examples are then declined,
    and counted)."""
    defaults = {k: v[0] for k, v in table.items() if v}
    out, dropped = {}, []
    for key, values in table.items():
        keep = values[:1]
        for v in values[1:]:
            cfg, _ = config_of({**defaults, key: v})
            try:
                ok = supports(adapter, load_config(cfg, source="rlaudit fuzz"))[0]
            except InputError:
                ok = True       # the reference rejects it alone: left to the example's checks
            if ok:
                keep.append(v)
            else:
                dropped.append(f"{key}={v}")
        out[key] = keep
    return out, dropped


def example_strategy(adapter, rows: int, groups: int):
    """Knob values, which prompt groups of the built-in rollout are dropped (whole groups: every
    group keeps ``rollout.n`` rows, which trainers laying a batch out as prompts x n need) and
    the order of the rows (a group's rows scattered)."""
    return example_strategy_of(knobs(adapter), rows, groups)


def example_strategy_of(table: dict, rows: int, groups: int):
    """:func:`example_strategy` over a knob ``table`` (e.g. :func:`accepted`'s)."""

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
