"""AReaL's stages on hand-worked inputs, in a process of their own: importing AReaL replaces
``logging.root`` (its ``getLogger`` does on every call), which must not reach other tests. Writes
the adapter's outputs as JSON to OUT; test_areal.py compares them with values worked by hand.

    python tests/targets/peers/areal_probe.py 1.0.4 OUT.json
"""

from __future__ import annotations

import json
import sys
import warnings

import torch


def main(version: str) -> dict:
    warnings.filterwarnings("ignore")
    from rlaudit.targets.peers import activate
    activate("areal", version)
    from rlaudit.targets.peers.areal import ArealAdapter
    a = ArealAdapter()
    f64 = dict(dtype=torch.float64)
    out = {}

    rewards = torch.zeros(4, 3, **f64)
    rewards[:, 2] = torch.tensor([1.0, 2.0, 0.0, 0.0])
    adv, _ = a.compute_advantages(
        estimator="grpo", token_level_rewards=rewards, response_mask=torch.ones(4, 3, dtype=bool),
        uid=torch.tensor([5, 8, 5, 8]))
    out["grpo_adv"] = adv.tolist()

    _, ret = a.compute_advantages(
        estimator="reinforce_plus_plus", token_level_rewards=torch.tensor([[1.0, 5.0, 2.0]], **f64),
        response_mask=torch.tensor([[True, False, True]]), uid=torch.tensor([0]), gamma=0.5)
    out["rfpp_returns"] = [float(ret[0, 0]), float(ret[0, 2])]

    logp = torch.tensor([[-0.5, -1.0]], **f64, requires_grad=True)
    loss, _ = a.policy_loss(
        old_log_prob=torch.tensor([[-2.0, -1.0]], **f64), log_prob=logp,
        advantages=torch.tensor([[-1.0, 7.0]], **f64), response_mask=torch.tensor([[True, False]]),
        loss_mode="vanilla", loss_agg_mode="token-mean", clip_ratio_low=0.2,
        clip_ratio_high=0.2, clip_ratio_c=3.0)
    loss.backward()
    out["dual_clip_loss"] = float(loss)
    out["dual_clip_grad"] = logp.grad.tolist()

    try:
        a.compute_advantages(estimator="rloo", token_level_rewards=torch.ones(3, 2, **f64),
                             response_mask=torch.ones(3, 2, dtype=bool),
                             uid=torch.tensor([0, 0, 1]))
        out["unequal_groups"] = "ran"
    except NotImplementedError as e:
        out["unequal_groups"] = str(e)
    return out


if __name__ == "__main__":
    result = main(sys.argv[1])
    with open(sys.argv[2], "w") as f:
        json.dump(result, f)
