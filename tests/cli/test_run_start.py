"""`rlaudit run` starts the ranks' forkserver early only when some scenario will fork CPU ranks
(rlaudit.cli.run._forks_ranks reads the scenario files' backends and device)."""

from __future__ import annotations

import pytest
import yaml

from rlaudit.cli.run import _forks_ranks


def _scenario(tmp_path, name, **spec):
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


@pytest.mark.parametrize("spec, backends, device, expected", [
    ({"backends": {"reference": {}, "fsdp": {"dp": 2}}}, None, None, True),
    ({"backends": {"reference": {}}}, None, None, False),
    ({"backends": {"reference": {}, "fsdp": {"dp": 2}}}, ["reference"], None, False),
    ({"backends": {"reference": {}, "megatron": {"tp": 2}}}, ["reference", "megatron"], None,
     True),
    ({"backends": {"fsdp": {}}, "device": "cuda"}, None, None, False),
    ({"backends": {"fsdp": {}}, "device": "cuda"}, None, "cpu", True),
    ({"backends": {"fsdp": {}}}, None, "cuda", False),
])
def test_forks_ranks_only_for_multi_rank_backends_on_cpu(tmp_path, spec, backends, device,
                                                         expected):
    assert _forks_ranks(_scenario(tmp_path, "s", **spec), backends, device) is expected


def test_an_unreadable_scenario_is_left_to_validation(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("backends: [unclosed")
    assert _forks_ranks(bad, None, None) is False
    assert _forks_ranks(tmp_path / "missing.yaml", None, None) is False
