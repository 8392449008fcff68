"""How verl's FSDP step maps rlaudit's KL and rollout-correction settings (verl_kl.py, verl_train.
verl_overrides) and lays verl's rollout-correction metrics out under rlaudit's names
(verl_step.correction_renames, per_responding_row): hand-worked values, no verl needed."""

from __future__ import annotations

import torch

from rlaudit.config import load_config
from rlaudit.targets.peers.verl_kl import kl_refusals, rollout_is_threshold
from rlaudit.targets.peers.verl_step import correction_renames, per_responding_row
from rlaudit.targets.peers.verl_train import unsupported, verl_overrides


def _cfg(**actor):
    return load_config({"rollout": {"n": 4}, "actor": actor})


def _rc(**rc):
    return _cfg(rollout_correction=rc)


def test_kl_is_mapped_as_verl_names_it():
    cfg = load_config({"algorithm": {"use_kl_in_reward": True, "kl_penalty": "mse",
                                     "kl_coef": 0.05},
                       "actor": {"use_kl_loss": True, "kl_loss_type": "low_var_kl",
                                 "kl_loss_coef": 0.1}})
    assert unsupported(cfg) == []
    o = verl_overrides(cfg, model_path="m", dp=1)
    a = "actor_rollout_ref.actor."
    assert (o[f"{a}use_kl_loss"], o[f"{a}kl_loss_type"], o[f"{a}kl_loss_coef"]) == (
        True, "low_var_kl", 0.1)
    assert (o["algorithm.use_kl_in_reward"], o["algorithm.kl_penalty"]) == (True, "mse")
    assert (o["algorithm.kl_ctrl.type"], o["algorithm.kl_ctrl.kl_coef"]) == ("fixed", 0.05)
    # the reference engine as the actor's: float32, and not forward-only on the CPU
    assert o["actor_rollout_ref.ref.fsdp_config.model_dtype"] == "fp32"
    assert o["actor_rollout_ref.ref.fsdp_config.forward_only"] is False
    cuda = verl_overrides(cfg, model_path="m", dp=1, device="cuda")
    assert "actor_rollout_ref.ref.fsdp_config.forward_only" not in cuda


def test_what_means_something_else_in_verl_is_refused():
    def refused(cfg):
        return [why for why, bad in kl_refusals(cfg).items() if bad]

    assert refused(_cfg()) == []
    k3_unclamped = load_config({"algorithm": {"k3_clamp": "none"},
                                "actor": {"use_kl_loss": True, "kl_loss_type": "k3"}})
    assert any("k3_clamp" in w for w in refused(k3_unclamped))
    # the clamp is unread without a k3 term
    assert refused(load_config({"algorithm": {"k3_clamp": "none"},
                                "actor": {"use_kl_loss": True, "kl_loss_type": "k2"}})) == []
    assert any("kl_loss_weight" in w for w in refused(
        _cfg(use_kl_loss=True, kl_loss_weight="ratio")))
    assert any("geometric" in w for w in refused(_rc(rollout_is="geometric")))
    assert any("mask at sequence" in w for w in refused(
        _rc(rollout_is="sequence", rollout_is_mode="mask")))
    assert refused(_rc(rollout_is="token", rollout_is_mode="mask")) == []
    assert any("rollout-KL" in w for w in refused(_rc(use_rollout_kl_loss=True)))
    assert any("rollout-KL" in w for w in unsupported(_rc(use_rollout_kl_loss=True)))


def test_rollout_is_threshold_in_verl_terms():
    # truncation: the upper bound; mask: IcePop's "lower_upper" band, lower 1 / threshold
    # when rlaudit leaves it unset
    assert rollout_is_threshold(_rc(rollout_is="token", rollout_is_threshold=1.5)) == 1.5
    assert rollout_is_threshold(_rc(rollout_is="token", rollout_is_mode="mask",
                                    rollout_is_threshold=2.0)) == "0.5_2.0"
    assert rollout_is_threshold(_rc(rollout_is="token", rollout_is_mode="mask",
                                    rollout_is_threshold=1.25,
                                    rollout_is_threshold_lower=0.6)) == "0.6_1.25"
    o = verl_overrides(_rc(rollout_is="sequence", rollout_is_threshold=1.5), model_path="m",
                       dp=1)
    at = "algorithm.rollout_correction."
    assert (o[f"{at}rollout_is"], o[f"{at}rollout_is_threshold"], o[f"{at}rollout_rs"],
            o[f"{at}bypass_mode"], o[f"{at}rollout_is_batch_normalize"]) == (
        "sequence", 1.5, None, False, False)


def test_clip_fraction_names():
    frac, oob = ("rollout_corr/rollout_is_ratio_fraction_high",
                 "rollout_corr/rollout_is_oob_ratio")
    assert correction_renames(_cfg()) == {}
    assert correction_renames(_rc(rollout_is="token")) == {frac: "rollout_corr/is_clipfrac"}
    assert correction_renames(_rc(rollout_is="sequence")) == {frac: "rollout_corr/is_clipfrac"}
    assert correction_renames(_rc(rollout_is="token", rollout_is_mode="mask")) == {
        oob: "rollout_corr/is_clipfrac"}


class _Rows:
    """A batch as per_responding_row reads it: its rows and their response lengths."""

    def __init__(self, lengths):
        self.lengths = torch.tensor(lengths)

    def __len__(self):
        return len(self.lengths)

    def __getitem__(self, key):
        assert key == "response_lengths"
        return self.lengths


def test_sequence_clip_fraction_over_the_rows_with_a_response():
    name = "rollout_corr/is_clipfrac"
    batch = _Rows([3, 0, 2, 5])            # one empty response of four rows
    seq = _rc(rollout_is="sequence", rollout_is_threshold=1.5)
    # verl: 1 row above the threshold / 4 rows; rlaudit: 1 / 3 rows with a response
    assert per_responding_row({name: 0.25}, seq, batch)[name] == 1 / 3
    # threshold below 1: the empty row's log-ratio sum 0 is above it too: verl 2 / 4
    low = _rc(rollout_is="sequence", rollout_is_threshold=0.8)
    assert per_responding_row({name: 0.5}, low, batch)[name] == 1 / 3
    # token level, or no empty row: verl's value as it is
    assert per_responding_row({name: 0.25}, _rc(rollout_is="token"), batch)[name] == 0.25
    assert per_responding_row({name: 0.25}, seq, _Rows([3, 1, 2, 5]))[name] == 0.25
