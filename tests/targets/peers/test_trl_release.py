"""What the TRL adapter reads from the release it audits, with hand-built stand-ins (no TRL
install needed): the report column names the release, and a ``GRPOConfig`` key the release lacks
is either left out (its value asks for nothing the release lacks) or an ``UnsupportedFeature``
naming the key and the release, raised before the config is built -- never a crash that reads as
a failed check.
"""

from __future__ import annotations

import dataclasses

import pytest

from rlaudit.targets import UnsupportedFeature
from rlaudit.targets.peers import trl as trl_peer
from rlaudit.targets.peers.trl_release import release_config_kwargs


@dataclasses.dataclass
class OldGRPOConfig:
    """A release's GRPOConfig as TRL 1.0.0-1.5.1 have it: no ``entropy_coef`` field."""
    output_dir: str = ""
    beta: float = 0.0
    delta: float | None = None


@dataclasses.dataclass
class NewGRPOConfig(OldGRPOConfig):
    entropy_coef: float = 0.0


@pytest.mark.parametrize("version", ["1.5.1", "1.16.0", "1.0.0"])
def test_report_column_names_the_release(monkeypatch, version):
    monkeypatch.setattr(trl_peer, "trl_version", lambda: version)
    adapter = trl_peer.TRLAdapter()
    assert adapter.name == "trl-" + version
    assert adapter.version == version


def test_a_missing_key_at_its_neutral_value_is_left_out():
    kw = {"output_dir": "/tmp/x", "beta": 0.04, "delta": 3.0, "entropy_coef": 0.0}
    out = release_config_kwargs(OldGRPOConfig, kw, "1.5.1")
    assert out == {"output_dir": "/tmp/x", "beta": 0.04, "delta": 3.0}
    assert OldGRPOConfig(**out).delta == 3.0          # the release builds it
    assert "entropy_coef" in kw                        # the caller's dict is left alone


def test_a_release_with_every_key_gets_them_all():
    kw = {"output_dir": "/tmp/x", "beta": 0.0, "delta": None, "entropy_coef": 0.01}
    assert release_config_kwargs(NewGRPOConfig, kw, "1.16.0") == kw


def test_a_missing_key_the_scenario_needs_is_unsupported_naming_key_and_release():
    kw = {"output_dir": "/tmp/x", "beta": 0.0, "delta": None, "entropy_coef": 0.01}
    with pytest.raises(UnsupportedFeature) as e:
        release_config_kwargs(OldGRPOConfig, kw, "1.5.1")
    assert e.value.release == "TRL 1.5.1"
    assert "entropy_coef=0.01" in e.value.feature
    assert "TRL 1.5.1 lacks GRPOConfig entropy_coef=0.01" in str(e.value)
    assert isinstance(e.value, NotImplementedError)    # the contract's "not supported here"


def test_a_missing_key_with_no_neutral_value_is_unsupported_whatever_its_value():
    @dataclasses.dataclass
    class NoDelta:
        output_dir: str = ""

    with pytest.raises(UnsupportedFeature) as e:
        release_config_kwargs(NoDelta, {"output_dir": "", "delta": None, "entropy_coef": 0.0},
                              "1.0.0")
    # entropy_coef 0 is left out; delta, even None, is not known to be neutral: named alone
    assert e.value.feature.startswith("GRPOConfig delta=None ")
    assert "entropy_coef" not in e.value.feature
