"""verl's actor and algorithm config keys are each accounted for (rlaudit/targets/peers/
verl_knobs.py) against what the verl adapter's train_step (verl >= 0.9, its FSDP engine) sets:
mapped from rlaudit's config and varied by a shipped scenario or a run-level fuzz draw (else a
reason it is not), or not set with the reason; docs/targets.md's verl knob table is what the
mapping gives. Skipped unless verl 0.9+ is installed (make peers)."""

from __future__ import annotations

import dataclasses
import importlib.util
import re
from pathlib import Path

import pytest
import yaml

from rlaudit.errors import InputError
from rlaudit.targets.peers import activate, installed_versions

try:
    activate("verl", None)
    if importlib.util.find_spec("verl") is None:
        raise ImportError("No module named 'verl'")
except (InputError, ImportError) as e:  # pragma: no cover - depends on the machine
    pytest.skip(f"verl is not installed ({installed_versions('verl')}): {e}",
                allow_module_level=True)

from rlaudit.targets.fuzz.coverage import coverage  # noqa: E402
from rlaudit.targets.peers import verl_knobs  # noqa: E402
from rlaudit.targets.peers.verl_step import engines_of  # noqa: E402
from rlaudit.targets.peers.verl_train import DEFAULT_CONFIG  # noqa: E402
from peer_cli import REPO  # noqa: E402

if engines_of().get("fsdp") != "engine":  # pragma: no cover - depends on the machine
    pytest.skip("the installed verl's train_step is not the FSDP engine's (verl 0.9+): the "
                "table is of verl_train.verl_overrides", allow_module_level=True)

pytestmark = pytest.mark.slow
DOC = REPO / "docs" / "targets.md"


@pytest.fixture(autouse=True, scope="module")
def _verl_active():
    """verl's directory first on the path again (see test_trl_knobs)."""
    activate("verl", None)


@pytest.fixture(scope="module")
def adapter():
    from rlaudit.targets.peers.verl import VerlAdapter
    return VerlAdapter()


@pytest.fixture(scope="module")
def cov(adapter):
    return coverage(adapter, verl_knobs.verl_knobs_of, REPO / "scenarios")


def _mapped() -> set[str]:
    from rlaudit.targets.inputs import builtin
    return set(verl_knobs.verl_knobs_of(builtin.config(), 16, builtin.MAX_NEW_TOKENS, 1))


def test_every_actor_and_algorithm_key_is_mapped_or_listed():
    generated = Path(importlib.util.find_spec("verl").origin).parent / DEFAULT_CONFIG
    keys = verl_knobs.config_keys(yaml.safe_load(generated.read_text()))
    assert len(keys) > 100      # the generated config was found and read
    mapped = _mapped()
    unaccounted = [k for k in keys if k not in mapped and verl_knobs.not_set_reason(k) is None]
    assert not unaccounted, f"verl config keys neither mapped nor in NOT_SET: {unaccounted}"
    assert not set(verl_knobs.NOT_SET) & mapped
    assert all(why.strip() for why in verl_knobs.NOT_SET.values())
    # a group entry covers what is under it, the longest group wins
    assert verl_knobs.not_set_reason("algorithm.kl_ctrl.horizon") == verl_knobs.NOT_SET[
        "algorithm.kl_ctrl."]
    assert verl_knobs.not_set_reason(f"{verl_knobs.ACTOR}fsdp_config.qat.mode") == \
        verl_knobs.NOT_SET[f"{verl_knobs.ACTOR}fsdp_config.qat."]


def test_every_mapped_key_is_varied_somewhere(cov):
    assert cov.unvaried(set(verl_knobs.not_varied())) == []
    # the reasons are for keys the mapping has, and those keys really are varied nowhere
    assert set(verl_knobs.not_varied()) <= set(cov.baseline)
    assert not [k for k in verl_knobs.not_varied() if cov.varied_by.get(k)]
    # hand-listed: what the shipped scenarios vary for verl's step
    a = verl_knobs.ACTOR
    assert {s.split(":")[0] for s in cov.varied_by["actor_rollout_ref.rollout.n"]} == {
        "trl_group_of_three"}
    assert "ppo_dual_clip" in cov.varied_by[f"{a}clip_ratio_c"]
    assert {"policy_gspo", "policy_cispo"} <= {s.split(":")[0] for s in
                                               cov.varied_by[f"{a}policy_loss.loss_mode"]}
    assert "adv_rloo" in cov.varied_by["algorithm.adv_estimator"]
    # gamma 0.9 with REINFORCE++, the one scenario that discounts
    assert {s.split(":")[0] for s in cov.varied_by["algorithm.gamma"]} == {
        "adv_reinforce_discount"}


def test_a_key_varied_nowhere_fails(cov):
    """The check above can fail: with the one scenario that varies rollout.n and the one that
    varies gamma taken out, both are reported."""
    drop = {"trl_group_of_three", "adv_reinforce_discount"}
    cut = dataclasses.replace(cov, varied_by={
        k: [s for s in v if s.split(":")[0] not in drop] for k, v in cov.varied_by.items()})
    assert {"actor_rollout_ref.rollout.n", "algorithm.gamma"} <= set(
        cut.unvaried(set(verl_knobs.not_varied())))


def test_docs_table_is_the_mapping(adapter):
    text = DOC.read_text()
    m = re.search(r"<!-- knob-table:verl begin -->\n(.*?)\n<!-- knob-table:verl end -->", text,
                  re.S)
    assert m, "docs/targets.md lacks the knob-table:verl markers"
    want = verl_knobs.docs_block(adapter, REPO / "scenarios")
    assert m.group(1) == want, "docs/targets.md's verl knob table is stale; regenerate:\n" + want
