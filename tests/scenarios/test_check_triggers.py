"""Every check reports only what it checked, on every shipped scenario: an invariant whose
trigger is off is n/a with the reason, never a pass; reward-shaping (whose score placement is
always checked) names the overlong penalty and the group filter only where they are on. The
triggers are restated here from the scenario files' raw YAML (not from rlaudit's trigger
functions), and the run handed to the checks is one an ungated check would pass on."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

from rlaudit.backends.base import VariantRun
from rlaudit.data.io import load_rollout
from rlaudit.scenarios.invariants import INVARIANTS, CheckContext
from rlaudit.scenarios.invariants.base import with_overrides
from rlaudit.scenarios.spec import load_scenario
from rlaudit.update.step import select_groups
from rlaudit.verdict.result import NA, PASS

SCENARIOS = sorted((Path(__file__).resolve().parents[2] / "scenarios").glob("*.yaml"))


def _on(raw: dict, *keys: str) -> bool:
    node = raw.get("config") or {}
    for k in keys:
        node = (node or {}).get(k, {})
    return node is True


#: invariant -> is its trigger on, from the scenario file's raw YAML
TRIGGERS = {
    "filter-metric": lambda raw: (_on(raw, "reward", "overlong_buffer", "enable")
                                  and _on(raw, "algorithm", "filter_groups", "enable")),
    "kl-loss-direction": lambda raw: raw.get("ref_model") is not None,
    "reward-logging": lambda raw: bool(_sidecar_meta(raw).get("reward_functions")),
}


def _sidecar_meta(raw: dict) -> dict:
    """The ``meta`` of the scenario's rollout sidecar (``x.safetensors`` -> ``x.json``)."""
    side = (SCENARIOS[0].parent / raw["rollout"]).with_suffix(".json")
    return yaml.safe_load(side.read_text())["meta"]


def _scores_on_last_token(batch) -> torch.Tensor:
    """[B, R]: each row's score on its last response token, by a loop (no penalty)."""
    out = torch.zeros(batch.batch_size, batch.response_width, dtype=torch.float64)
    for i, (n, s) in enumerate(zip(batch["response_lengths"].tolist(),
                                   batch["scores"].tolist())):
        if n > 0:
            out[i, n - 1] = s
    return out


def _context(scn) -> CheckContext:
    batch, _ = select_groups(load_rollout(scn.rollout), scn.config)
    run = VariantRun(name="base", steps=[{}],
                     tokens={"token_level_scores": _scores_on_last_token(batch)})
    return CheckContext(scenario=scn, batch=batch, runs={"reference": {"base": run}})


def test_the_restated_triggers_are_rlaudits():
    assert {n for n in INVARIANTS if INVARIANTS.get(n).trigger} == set(TRIGGERS)


def test_no_check_passes_without_its_trigger_on_any_shipped_scenario():
    off, claims = [], 0
    for path in SCENARIOS:
        raw = yaml.safe_load(path.read_text())
        scn = load_scenario(path)
        ctx = _context(scn)
        for name, on in TRIGGERS.items():
            if on(raw):
                assert INVARIANTS.get(name).applies(scn) is None, (path.name, name)
                continue
            got = INVARIANTS.get(name).check(ctx)
            assert got and all(r.status == NA for r in got), (path.name, name,
                                                              [r.message for r in got])
            assert all(r.message for r in got)
            off.append((path.stem, name))
        if _on(raw, "reward", "overlong_buffer", "enable"):
            continue        # the fake run has no penalty: test_reward_shaping_names_... below
        (res,) = INVARIANTS.get("reward-shaping").check(ctx)
        assert res.status == PASS, (path.name, res.message)
        assert "overlong" not in res.message, (path.name, res.message)
        assert ("group filter" in res.message) == _on(raw, "algorithm", "filter_groups",
                                                      "enable"), (path.name, res.message)
        claims += 1
    # most shipped scenarios have no DAPO filter and no reference policy of their own
    assert len(off) >= len(SCENARIOS), off
    assert ("adv_grpo_std", "kl-loss-direction") in off
    assert claims >= len(SCENARIOS) - 2


def _dapo(**overrides):
    path = next(p for p in SCENARIOS if p.stem == "dapo_filter_overlong")
    scn = load_scenario(path)
    import dataclasses
    return dataclasses.replace(scn, config=with_overrides(scn.config, **overrides))


def test_reward_shaping_names_only_what_was_on():
    scn = _dapo(**{"reward.overlong_buffer.enable": False})
    (res,) = INVARIANTS.get("reward-shaping").check(_context(scn))
    assert res.status == PASS, res.message
    assert "group filter" in res.message and "overlong" not in res.message
    # the penalty on: DAPO's expected length 13 - 4 = 9, penalty min(-(n - 9) / 4, 0) by hand
    scn = _dapo()
    ctx = _context(scn)
    lengths = ctx.batch["response_lengths"].tolist()
    pen = [min(-(n - 9) / 4, 0.0) for n in lengths]
    tokens = ctx.runs["reference"]["base"].tokens["token_level_scores"].clone()
    for i, n in enumerate(lengths):
        if n > 0:
            tokens[i, n - 1] += pen[i]
    ctx.runs["reference"]["base"] = VariantRun(
        name="base", tokens={"token_level_scores": tokens},
        steps=[{"train/overlong_penalty_mean": sum(pen) / len(pen)}])
    (res,) = INVARIANTS.get("reward-shaping").check(ctx)
    assert res.status == PASS, res.message
    assert "overlong penalty" in res.message and "group filter" in res.message
    assert any(p < 0 for p in pen)        # the penalty bites on this rollout


@pytest.mark.parametrize("name", sorted(TRIGGERS))
def test_the_reason_names_the_switch(name):
    scn = load_scenario(next(p for p in SCENARIOS if p.stem == "adv_grpo_std"))
    why = INVARIANTS.get(name).applies(scn)
    assert why and ("enable" in why or "reference policy" in why
                    or "meta.reward_functions" in why), why
