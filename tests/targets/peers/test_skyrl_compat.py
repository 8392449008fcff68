"""skyrl_compat on hand-built stand-ins for a release's conversion: the pad argument each
release takes, the response layout read off the function itself, and what is unsupported."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from rlaudit.targets import UnsupportedFeature
from rlaudit.targets.peers import skyrl_compat


def _layout(pad_id, responses, right):
    width = max(len(r) for r in responses)
    mask = torch.zeros(len(responses), width, dtype=torch.int64)
    for i, r in enumerate(responses):
        if right:
            mask[i, width - len(r):] = 1
        else:
            mask[i, :len(r)] = 1
    return (f"seq(pad={pad_id})", "attn", mask, "rewards", "loss", "logprobs", "experts", "extra")


def new_convert(pad_token_id, prompts, responses, rewards, loss_masks, logprobs=None):
    return _layout(pad_token_id, responses, right=True)            # SkyRL 0.4


def tokenizer_convert(tokenizer, prompts, responses, rewards, loss_masks, logprobs=None,
                      rollout_expert_indices=None):
    return _layout(tokenizer.pad_token_id, responses, right=True)  # SkyRL 0.2, 0.3


def left_convert(tokenizer, prompts, responses, rewards, loss_masks, logprobs=None):
    return _layout(tokenizer.pad_token_id, responses, right=False)  # SkyRL 0.1


def sky(convert, version="x"):
    return SimpleNamespace(version=version, preprocess=SimpleNamespace(
        convert_prompts_responses_to_batch_tensors=convert))


@pytest.mark.parametrize("convert", [new_convert, tokenizer_convert])
def test_the_pad_argument_each_release_takes_and_six_outputs(convert):
    out = skyrl_compat.batch_tensors(sky(convert), [[1]], [[2, 3]], [[0.0, 0.0]], [[1, 1]], None)
    assert len(out) == 6 and out[0] == "seq(pad=0)"


def test_a_release_that_right_pads_responses_is_unsupported():
    with pytest.raises(UnsupportedFeature, match="skyrl-0.1.0 lacks right-aligned"):
        skyrl_compat.batch_tensors(sky(left_convert, "0.1.0"), [[1]], [[2]], [[0.0]], [[1]], None)


def test_missing_scaling_or_iterator_is_unsupported():
    old = SimpleNamespace(version="0.1.0", ppo=SimpleNamespace(), workers=SimpleNamespace())
    with pytest.raises(UnsupportedFeature, match="apply_loss_reduction_to_advantages_minibatch"):
        skyrl_compat.require_advantage_scaling(old)
    with pytest.raises(UnsupportedFeature, match="get_microbatch_iterator"):
        skyrl_compat.require_microbatch_iterator(old)
