"""One installed verl version, in its own process (two verl versions cannot share one): hand-worked
inputs through the adapter, written as JSON to OUT, then the CLI as a user runs it,
``rlaudit run --target verl==VERSION --json`` (its stdout and exit code are this script's).

    python tests/targets/peers/verl_probe.py 0.9.1 OUT.json REPORT_DIR

test_verl.py runs it once per version (importing verl costs ~10 s: one process does both).
"""

from __future__ import annotations

import json
import sys
import warnings

import torch


def main(version: str) -> dict:
    warnings.filterwarnings("ignore")
    from rlaudit.algo.agg import Denominators
    from rlaudit.targets.stages.batch import microbatch_input
    from rlaudit.targets.peers import activate
    activate("verl", version)
    from rlaudit.targets.peers.verl import VerlAdapter
    a = VerlAdapter()
    out = {"version": a.version, "name": a.name}
    f64 = dict(dtype=torch.float64)

    # REINFORCE++ with a tool-output token (mask 0) between two actions, gamma 0.5
    _, ret = a.compute_advantages(
        estimator="reinforce_plus_plus", token_level_rewards=torch.tensor([[0.0, 0.0, 1.0]], **f64),
        response_mask=torch.tensor([[True, False, True]]), uid=torch.tensor([0]), gamma=0.5)
    out["rfpp_returns"] = [float(ret[0, 0]), float(ret[0, 2])]

    # GRPO, one group of two rows; row 1 has a reward of 5 on a masked position
    adv, ret = a.compute_advantages(
        estimator="grpo", token_level_rewards=torch.tensor([[1.0, 0.0], [0.0, 5.0]], **f64),
        response_mask=torch.tensor([[True, True], [True, False]]), uid=torch.tensor([7, 7]))
    out["grpo_adv_row0"] = float(adv[0, 0])
    out["grpo_returns_is_advantages"] = ret is adv

    # GSPO on-policy (ratio 1, loss = -A): rows of 2 and 1 valid tokens, A = 1, 1 and 4
    mask = torch.tensor([[True, True], [True, False]])
    lp = torch.tensor([[-1.0, -2.0], [-0.5, 0.0]], **f64)
    adv = torch.tensor([[1.0, 1.0], [4.0, 0.0]], **f64)
    for agg in ("token-mean", "seq-mean-token-mean"):
        loss, _ = a.policy_loss(old_log_prob=lp, log_prob=lp.clone(), advantages=adv,
                                response_mask=mask, loss_mode="gspo", loss_agg_mode=agg,
                                clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0)
        out[f"gspo_{agg}"] = float(loss)
    # vanilla on-policy (loss -A per token) as one micro-batch of a mini-batch of 6 valid
    # tokens: its contribution -(1 + 1 + 4) / 6 is the loss and the logged actor/pg_loss
    loss, metrics = a.policy_loss(old_log_prob=lp, log_prob=lp.clone(), advantages=adv,
                                  response_mask=mask, loss_mode="vanilla",
                                  loss_agg_mode="token-mean", clip_ratio_low=0.2,
                                  clip_ratio_high=0.28, clip_ratio_c=3.0,
                                  denominators=Denominators(tokens=6, seqs=4, norm_len=2))
    out["vanilla_contribution"] = [float(loss), float(metrics["actor/pg_loss"])]

    # agg_loss on a batch without a valid token: local counts vs global ones
    empty = dict(loss_mat=torch.tensor([[1.0, 2.0]], **f64), mask=torch.tensor([[False, False]]),
                 mode="token-mean")
    out["agg_empty_local"] = float(a.agg_loss(**empty))
    out["agg_empty_global"] = float(a.agg_loss(**empty, denominators=Denominators(4, 2, 2)))

    # straight-through k3+: value of k3, gradient of k2 (= log_prob - ref)
    try:
        x = torch.tensor([[-1.0]], **f64, requires_grad=True)
        v = a.kl_penalty(log_prob=x, ref_log_prob=torch.tensor([[-1.5]], **f64), kind="k3+")
        (g,) = torch.autograd.grad(v.sum(), x)
        out["k3plus"] = [float(v), float(g)]
    except NotImplementedError as e:
        out["k3plus"] = f"NotImplementedError: {e}"

    # the vectorized estimators (VerlVectorizedAdapter): Dr.GRPO on groups {1, 0} and {1, 1}
    # (row 0: 1 - 0.5), and RLOO on a single-response prompt with score 2
    from rlaudit.targets.peers.verl import VerlVectorizedAdapter
    vec = VerlVectorizedAdapter()
    adv, _ = vec.compute_advantages(
        estimator="drgrpo", token_level_rewards=torch.tensor([[1.0], [0.0], [1.0], [1.0]], **f64),
        response_mask=torch.ones(4, 1, dtype=torch.bool), uid=torch.tensor([0, 0, 1, 1]))
    out["drgrpo_vectorized_row0"] = float(adv[0, 0])
    one = dict(token_level_rewards=torch.tensor([[2.0]], **f64),
               response_mask=torch.ones(1, 1, dtype=torch.bool), uid=torch.tensor([3]))
    out["rloo_singleton"] = float(a.compute_advantages(estimator="rloo", **one)[0][0, 0])
    out["rloo_vectorized_singleton"] = float(vec.compute_advantages(estimator="rloo", **one)[0][0, 0])

    # micro-batches per DP rank under a token budget (the stage checks' 12-row batch)
    ranks = a.make_microbatches(microbatch_input(), dp_size=2, max_token_len=16)
    out["microbatches_per_rank"] = [len(r) for r in ranks]
    return out


if __name__ == "__main__":
    version, out_path, report_dir = sys.argv[1:4]
    with open(out_path, "w") as fh:
        json.dump(main(version), fh)
    from rlaudit.cli.main import main as cli
    sys.exit(cli(["run", "--target", f"verl=={version}", "--json", "--no-mlflow",
                  "--report-dir", report_dir]))
