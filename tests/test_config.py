import pytest

from rlaudit.config import Config
from rlaudit.dicts import flatten, from_dict, to_dict
from rlaudit.errors import InputError


def test_unknown_key_names_file_and_dotted_key():
    with pytest.raises(InputError) as e:
        from_dict(Config, {"actor": {"entropy_coef": 0.0}}, source="s.yaml")
    assert "s.yaml" in str(e.value) and "actor.entropy_coef" in str(e.value)
    assert e.value.key == "actor.entropy_coef"


def test_wrong_type_is_rejected():
    with pytest.raises(InputError, match="actor.calculate_entropy"):
        from_dict(Config, {"actor": {"calculate_entropy": "yes"}})
    with pytest.raises(InputError, match="rollout.n"):
        from_dict(Config, {"rollout": {"n": 2.5}})


def test_round_trip_and_flatten():
    cfg = from_dict(Config, {"actor": {"entropy_coeff": 0.01, "optim": {"betas": [0.8, 0.9]}},
                             "algorithm": {"filter_groups": {"enable": True}}})
    assert cfg.actor.entropy_coeff == 0.01 and cfg.actor.optim.betas == (0.8, 0.9)
    assert cfg.algorithm.filter_groups.enable is True
    again = from_dict(Config, to_dict(cfg))
    assert again == cfg
    flat = flatten(to_dict(cfg))
    assert flat["actor.optim.lr"] == cfg.actor.optim.lr and "algorithm.filter_groups.enable" in flat


def test_entropy_semantics_of_seed_1():
    # entropy is computed when either knob asks for it
    assert not Config().compute_entropy
    assert from_dict(Config, {"actor": {"calculate_entropy": True}}).compute_entropy
    assert from_dict(Config, {"actor": {"entropy_coeff": 0.01}}).compute_entropy
