"""TRL's GRPOConfig keys are each accounted for (rlaudit/targets/peers/trl_knobs.py): mapped
from rlaudit's config and varied by a shipped scenario or a run-level fuzz draw (else a reason
it is not), or not set with the reason; docs/targets.md's knob table is what the mapping gives.
Skipped unless TRL is installed (make peers)."""

from __future__ import annotations

import dataclasses
import importlib.util
import re

import pytest

from rlaudit.errors import InputError
from rlaudit.targets.peers import activate, installed_versions

try:
    activate("trl", None)
    if importlib.util.find_spec("trl") is None:
        raise ImportError("No module named 'trl'")
except (InputError, ImportError) as e:  # pragma: no cover - depends on the machine
    pytest.skip(f"TRL is not installed ({installed_versions('trl')}): {e}",
                allow_module_level=True)

from rlaudit.targets.fuzz.coverage import coverage  # noqa: E402
from rlaudit.targets.peers import trl_knobs  # noqa: E402
from rlaudit.targets.peers.trl import TRLAdapter  # noqa: E402
from peer_cli import REPO  # noqa: E402

pytestmark = pytest.mark.slow
DOC = REPO / "docs" / "targets.md"


@pytest.fixture(autouse=True, scope="module")
def _trl_active():
    """TRL's directory first on the path again when this module's tests run: collection
    imports every peer's test module, and each activation leaves the other peers' directories
    (registry.leave_other_peers), so the last module collected would otherwise win."""
    activate("trl", None)


@pytest.fixture(scope="module")
def cov():
    return coverage(TRLAdapter(), trl_knobs.trl_knobs_of, REPO / "scenarios")


def test_every_grpo_config_field_is_mapped_or_listed():
    import trl
    from transformers import TrainingArguments
    inherited = {f.name for f in dataclasses.fields(TrainingArguments)}
    own = {f.name for f in dataclasses.fields(trl.GRPOConfig)} - inherited
    mapped = set(trl_knobs.trl_knobs_of(*_default_args())) | {trl_knobs.OUTPUT_DIR}
    unaccounted = sorted(own - mapped - set(trl_knobs.NOT_SET))
    assert not unaccounted, f"GRPOConfig fields neither mapped nor in NOT_SET: {unaccounted}"
    assert not set(trl_knobs.NOT_SET) & mapped
    assert all(why.strip() for why in trl_knobs.NOT_SET.values())


def _default_args():
    from rlaudit.targets.inputs import builtin
    return builtin.config(), 8, builtin.MAX_NEW_TOKENS, 1


def test_every_mapped_key_is_varied_somewhere(cov):
    assert cov.unvaried(set(trl_knobs.not_varied())) == []
    # the reasons are for keys the mapping has, and those keys really are varied nowhere
    assert set(trl_knobs.not_varied()) <= set(cov.baseline)
    assert not [k for k in trl_knobs.not_varied() if cov.varied_by.get(k)]
    # hand-listed: what the two TRL scenarios added for this table vary
    assert {s.split(":")[0] for s in cov.varied_by["num_generations"]} == {"trl_group_of_three"}
    assert "trl_group_of_three" in cov.varied_by["entropy_coef"]
    assert "trl_two_minibatches" in cov.varied_by["optim"]
    # two reward functions weighted 1.0 and 0.5 (the rollout short-ref-rewards) against one of
    # weight 1 everywhere else
    assert cov.baseline["reward_weights"] == "[1.0]"
    assert {s.split(":")[0] for s in cov.varied_by["reward_weights"]} == {"trl_reward_weights"}


def test_a_key_varied_nowhere_fails(cov):
    """The check above can fail: with the three scenarios' contributions taken out, the keys
    only they vary are reported."""
    drop = {"trl_group_of_three", "trl_two_minibatches", "trl_reward_weights"}
    cut = dataclasses.replace(cov, varied_by={
        k: [s for s in v if s.split(":")[0] not in drop] for k, v in cov.varied_by.items()})
    assert set(cut.unvaried(set(trl_knobs.not_varied()))) >= {"num_generations",
                                                                 "entropy_coef", "optim",
                                                                 "reward_weights"}


def test_docs_table_is_the_mapping(cov):
    text = DOC.read_text()
    m = re.search(r"<!-- knob-table:trl begin -->\n(.*?)\n<!-- knob-table:trl end -->", text,
                  re.S)
    assert m, "docs/targets.md lacks the knob-table:trl markers"
    want = trl_knobs.docs_block(TRLAdapter(), REPO / "scenarios")
    assert m.group(1) == want, "docs/targets.md's TRL knob table is stale; regenerate:\n" + want
