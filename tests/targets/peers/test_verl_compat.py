"""verl_compat on hand-built stand-ins for a release's core_algos: features read from the
functions the release has, before any call (so an error inside verl's math stays a finding)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from rlaudit.targets import UnsupportedFeature
from rlaudit.targets.peers import verl_compat


def old_agg_loss(loss_mat, loss_mask, loss_agg_mode):          # verl 0.5.0's signature
    return (loss_mat * loss_mask).sum()


def new_agg_loss(loss_mat, loss_mask, loss_agg_mode, dp_size=1, batch_num_tokens=None,
                 global_batch_size=None, loss_scale_factor=None):
    return (loss_mat * loss_mask).sum()


def test_agg_loss_without_global_counts_is_unsupported_naming_the_release():
    with pytest.raises(UnsupportedFeature, match="verl-0.5.0 lacks agg_loss with global") as e:
        verl_compat.require_global_counts(SimpleNamespace(agg_loss=old_agg_loss),
                                          release="verl-0.5.0")
    assert e.value.details()["release"] == "verl-0.5.0"
    verl_compat.require_global_counts(SimpleNamespace(agg_loss=new_agg_loss), release="x")


def test_a_loss_mode_the_registry_lacks_is_unsupported_listing_what_it_has():
    core = SimpleNamespace(POLICY_LOSS_REGISTRY={"gpg": None, "kl_cov": None})
    with pytest.raises(UnsupportedFeature, match=r"'vanilla' .*registered: gpg, kl_cov"):
        verl_compat.require_policy_loss(core, "vanilla", release="verl-0.5.0",
                                        global_counts=False)


def test_value_loss_passes_global_counts_only_to_a_release_that_takes_them():
    seen = {}

    def old(*, vpreds, values, returns, response_mask, cliprange_value, loss_agg_mode):
        seen["old"] = True
        return vpreds.sum(), torch.tensor(0.25)

    def new(*, vpreds, values, returns, response_mask, cliprange_value, loss_agg_mode,
            dp_size=1, batch_num_tokens=None, global_batch_size=None, loss_scale_factor=None):
        seen["new"] = batch_num_tokens
        return vpreds.sum(), torch.tensor(0.5)

    denom = SimpleNamespace(tokens=7, seqs=3, norm_len=4)
    x = torch.ones(2, 3, dtype=torch.float64)
    kw = dict(vpreds=x, values=x, returns=x, response_mask=x.bool(), cliprange_value=0.2,
              loss_agg_mode="token-mean", denominators=denom)
    _, m = verl_compat.value_loss(SimpleNamespace(compute_value_loss=old), **kw)
    assert seen["old"] and m["critic/vf_clipfrac"] == 0.25
    verl_compat.value_loss(SimpleNamespace(compute_value_loss=new), **kw)
    assert seen["new"] == 7


def test_a_type_error_inside_the_function_is_not_turned_into_unsupported():
    def broken(*, vpreds, **_):
        raise TypeError("inside verl's math")

    x = torch.ones(1, 2)
    with pytest.raises(TypeError, match="inside verl's math"):
        verl_compat.value_loss(SimpleNamespace(compute_value_loss=broken), vpreds=x, values=x,
                               returns=x, response_mask=x.bool(), cliprange_value=0.2,
                               loss_agg_mode="token-mean")


def agg_loss_05(loss_mat, loss_mask, loss_agg_mode):
    seq_losses = torch.sum(loss_mat * loss_mask, dim=-1)
    return torch.mean(seq_losses)


def test_releases_without_global_counts_declare_their_row_count_convention():
    got = verl_compat.differences("0.5.0", SimpleNamespace(agg_loss=agg_loss_05))
    by_name = {d.name: d for d in got}
    rows = by_name["sequence-mean-over-all-rows"]
    assert rows.convention == {"seq_count": "all-rows"}
    # the link names the release tag and the line of the installed function that averages
    first = agg_loss_05.__code__.co_firstlineno
    assert rows.link.endswith(f"/blob/v0.5.0/verl/trainer/ppo/core_algos.py#L{first + 2}")
    assert by_name["token-sum-norm-without-row-count"].cases == ("seq-mean-token-sum-norm",)
    assert verl_compat.differences("0.9.1", SimpleNamespace(agg_loss=new_agg_loss)) == ()
