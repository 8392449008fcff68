"""OpenRLHF through `rlaudit run --target openrlhf`, and its stages on hand-worked examples.

OpenRLHF 0.11.2 (requirements/peers/openrlhf-0.11.2.txt, `make peers`) must exit 0 with only its
declared differences. 0.10.2, the release before OpenRLHF's fix of the sequence-level loss
(commits df78645e / 3a9815c5, released in 0.10.3: ``masked_mean(loss, action_mask, dim=-1)
.mean()`` divided a response without an action token by 0, so one empty response made the loss
and every gradient NaN), must fail ``policy_loss:parity`` on exactly those cases.
"""

from __future__ import annotations

import importlib.util
import math
import os
import subprocess
import sys

import pytest
import torch
from peer_cli import run_cli, statuses

from rlaudit.algo.agg import Denominators
from rlaudit.targets import peers

PINNED, BUGGY = "0.11.2", "0.10.2"
#: every test imports the peer (20-45 s) or runs the CLI over it
pytestmark = pytest.mark.slow


def _installed(version: str) -> None:
    path = peers.peers_dir() / f"openrlhf-{version}"
    if not (path / "openrlhf" / "__init__.py").is_file():
        pytest.skip(f"openrlhf=={version} is not installed under {peers.peers_dir()} (run `make "
                    f"peers`, docs/peers.md)")


#: set in the process of :func:`test_hand_worked_examples_in_their_own_process`
CHILD = "RLAUDIT_OPENRLHF_CHILD"


@pytest.fixture(scope="module")
def orl():
    """The adapter over the pinned release, in a pytest process of its own: OpenRLHF's import
    pulls in ~5,600 modules (deepspeed, accelerate and peft of its own pins among them), which
    would stay in a shared test worker and change what TRL's Trainer imports after it."""
    if not os.environ.get(CHILD):
        pytest.skip("runs in its own process: test_hand_worked_examples_in_their_own_process")
    _installed(PINNED)
    peers.activate("openrlhf", PINNED)
    from rlaudit.targets.peers.openrlhf import OpenRLHFAdapter  # lazy: needs the peer on the path
    return OpenRLHFAdapter()


# ---- the audit, as a user runs it ----------------------------------------------------------

def test_pinned_release_passes_with_only_declared_differences(tmp_path):
    _installed(PINNED)
    rc, checks, err = run_cli(tmp_path, f"openrlhf=={PINNED}")
    got = statuses(checks)
    assert {n for n, s in got.items() if s in ("fail", "error")} == set(), \
        {n: checks[n]["message"] for n, s in got.items() if s in ("fail", "error")}
    assert rc == 0, err[-2000:]
    for name in ("kl_penalty:parity", "apply_kl_in_reward:parity", "agg_loss:global-split",
                 "value_loss:parity", "value_loss:global-split",
                 "policy_loss:parity", "policy_loss:global-split", "policy_loss:masked-values",
                 "compute_advantages:row-permutation"):
        assert got[name] == "pass", (name, checks[name]["message"])
    assert got["compute_advantages:parity"] == "differs"
    assert set(checks["compute_advantages:parity"]["details"]["differences"]) == {
        "whiten-biased-variance", "recursions-through-masked-tokens",
        "baseline-returns-before-whitening"}
    assert got["agg_loss:parity"] == "differs"
    assert got["train_step:metrics-are-copies"] == "n/a"


def test_release_before_the_empty_row_fix_is_red(tmp_path):
    _installed(BUGGY)
    rc, checks, _ = run_cli(tmp_path, f"openrlhf=={BUGGY}")
    failed = {n for n, s in statuses(checks).items() if s in ("fail", "error")}
    assert rc == 1
    assert failed == {"policy_loss:parity"}
    problems = checks["policy_loss:parity"]["details"]["problems"]
    assert problems and all("seq-mean-token-mean" in p and "on ragged" in p
                            and "non-finite" in p for p in problems), problems
    # both loss types: the sequence-level PPO loss and GSPO (which forces it)
    assert {p.split("/")[0] for p in problems} == {"vanilla", "gspo"}


# ---- stages on hand-worked examples ---------------------------------------------------------

def test_hand_worked_examples_in_their_own_process():
    """Every test below (they take ``orl``), in one child pytest process."""
    _installed(PINNED)
    if os.environ.get(CHILD):
        pytest.skip("this is the child process")
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:randomly", "-p", "no:xdist",
         "-p", "no:cacheprovider", __file__, "-k", "not own_process and not release"],
        env={**os.environ, CHILD: "1"}, capture_output=True, text=True, timeout=600,
        cwd=os.path.dirname(__file__))
    tail = (proc.stdout + proc.stderr)[-3000:]
    assert proc.returncode == 0, tail
    assert "9 passed" in proc.stdout and "failed" not in proc.stdout, tail


def test_flash_attn_placeholders_leave_no_trace(orl):
    assert "flash_attn" not in sys.modules
    assert importlib.util.find_spec("flash_attn") is None


def test_whitening_uses_the_biased_variance(orl):
    # reinforce, gamma 1: returns [[1, 0], [0, 0]]; over 4 tokens mean 1/4, biased variance
    # 3/16: advantages (x - 1/4) / sqrt(3/16) = sqrt(3) and -1/sqrt(3) (rlaudit's unbiased
    # variance 1/4 would give 1.5 and -0.5)
    adv, ret = orl.compute_advantages(
        estimator="reinforce_plus_plus", token_level_rewards=torch.tensor([[1.0, 0.0], [0.0, 0.0]],
                                                                          dtype=torch.float64),
        response_mask=torch.ones(2, 2, dtype=torch.bool), uid=torch.tensor([0, 1]), gamma=1.0)
    r3 = math.sqrt(3.0)
    torch.testing.assert_close(ret, torch.tensor([[1.0, 0.0], [0.0, 0.0]], dtype=ret.dtype))
    torch.testing.assert_close(adv.double(), torch.tensor([[r3, -1 / r3], [-1 / r3, -1 / r3]],
                                                          dtype=torch.float64),
                               rtol=1e-6, atol=1e-6)


def test_returns_are_discounted_through_masked_positions(orl):
    # rewards [1, 5, 2], mask [1, 0, 1], gamma 0.5: the masked reward is zeroed, but the step is
    # discounted: G2 = 2, G1 = 0 + 0.5 * 2 = 1, G0 = 1 + 0.5 * 1 = 1.5 (rlaudit skips it: 2)
    _, ret = orl.compute_advantages(
        estimator="reinforce_plus_plus",
        token_level_rewards=torch.tensor([[1.0, 5.0, 2.0]], dtype=torch.float64),
        response_mask=torch.tensor([[True, False, True]]), uid=torch.tensor([0]), gamma=0.5)
    assert ret[0, 0].item() == pytest.approx(1.5)
    assert ret[0, 2].item() == pytest.approx(2.0)


def test_group_norm_finds_groups_by_uid_not_position(orl):
    # uid 7 holds rows 0 and 2 (scores 1, 0), uid 3 rows 1 and 3 (0, 0.5): each group has mean
    # m and unbiased std |a - b| / sqrt(2), so its rows get +-1/sqrt(2)
    rewards = torch.zeros(4, 2, dtype=torch.float64)
    rewards[:, 1] = torch.tensor([1.0, 0.0, 0.0, 0.5])
    adv, _ = orl.compute_advantages(
        estimator="grpo", token_level_rewards=rewards, response_mask=torch.ones(4, 2, dtype=bool),
        uid=torch.tensor([7, 3, 7, 3]))
    h = 1 / math.sqrt(2.0)
    want = torch.tensor([h, -h, -h, h], dtype=torch.float64).unsqueeze(1).expand(4, 2)
    torch.testing.assert_close(adv.double(), want, rtol=1e-6, atol=1e-6)


def test_unequal_groups_are_not_supported_rather_than_wrong(orl):
    with pytest.raises(NotImplementedError, match="same number of samples"):
        orl.compute_advantages(
            estimator="rloo", token_level_rewards=torch.ones(3, 2, dtype=torch.float64),
            response_mask=torch.ones(3, 2, dtype=bool), uid=torch.tensor([0, 0, 1]))


def test_reward_is_the_score_on_the_last_token_minus_kl(orl):
    # k1 kl = old - ref = [0.5, -0.25]; score 1 on the last token; coef 0.1:
    # rewards = [-0.05, 1 + 0.025]
    rewards, kl = orl.apply_kl_in_reward(
        token_level_scores=torch.tensor([[0.0, 1.0]], dtype=torch.float64),
        old_log_probs=torch.tensor([[-1.0, -1.0]], dtype=torch.float64),
        ref_log_probs=torch.tensor([[-1.5, -0.75]], dtype=torch.float64),
        response_mask=torch.ones(1, 2, dtype=bool), kl_coef=0.1, kl_penalty="k1")
    torch.testing.assert_close(kl.double(), torch.tensor([[0.5, -0.25]], dtype=torch.float64))
    torch.testing.assert_close(rewards.double(), torch.tensor([[-0.05, 1.025]],
                                                              dtype=torch.float64))


def test_dual_clip_caps_a_negative_advantage(orl):
    # A = -1, log ratio 1.5 (ratio 4.48): clipped surrogate min(-4.48, -1.2) = -4.48, the dual
    # clip raises it to c * A = -3: loss 3; its gradient is 0 (the cap does not depend on logp)
    logp = torch.tensor([[-0.5]], dtype=torch.float64, requires_grad=True)
    loss, metrics = orl.policy_loss(
        old_log_prob=torch.tensor([[-2.0]], dtype=torch.float64), log_prob=logp,
        advantages=torch.tensor([[-1.0]], dtype=torch.float64),
        response_mask=torch.ones(1, 1, dtype=bool), loss_mode="vanilla",
        loss_agg_mode="token-mean", clip_ratio_low=0.2, clip_ratio_high=0.2, clip_ratio_c=3.0)
    assert loss.item() == pytest.approx(3.0)
    loss.backward()
    assert logp.grad.item() == 0.0
    assert metrics["actor/ppo_kl"] == pytest.approx(-1.5)


#: old values V, predictions v, returns G for the value-loss examples: token 0 moves 1.0 from
#: its old value (outside a 0.2 window), token 1 moves 0.1 (inside it)
V, V_PRED, G = [[0.0, 0.0]], [[1.0, 0.1]], [[2.0, 0.0]]


def _value_loss(orl, **kw):
    vpred = torch.tensor(V_PRED, dtype=torch.float64, requires_grad=True)
    loss, metrics = orl.value_loss(
        vpreds=vpred, values=torch.tensor(V, dtype=torch.float64),
        returns=torch.tensor(G, dtype=torch.float64), response_mask=torch.ones(1, 2, dtype=bool),
        cliprange_value=0.2, loss_agg_mode="token-mean", **kw)
    loss.backward()
    return loss, metrics, vpred.grad


def test_value_loss_clips_around_the_old_values_with_a_half(orl):
    # token 0: unclipped (1 - 2)^2 = 1, clipped around V: (0 + 0.2 - 2)^2 = 3.24, the larger;
    # its prediction is outside the window, so gradient 0. Token 1: inside, both (0.1 - 0)^2 =
    # 0.01, gradient 0.5 * 2 * 0.1 / 2 tokens = 0.05. Loss 0.5 * (3.24 + 0.01) / 2 = 0.8125
    # (a clip around the returns would give (1.8 - 2)^2 = 0.04 vs 1 for token 0: 0.2525)
    loss, metrics, grad = _value_loss(orl)
    assert loss.item() == pytest.approx(0.8125)
    assert metrics["critic/vf_loss"] == pytest.approx(0.8125)
    torch.testing.assert_close(grad, torch.tensor([[0.0, 0.05]], dtype=torch.float64))


def test_value_loss_divides_by_the_global_token_count(orl):
    # the same two tokens in a mini-batch of 5 valid tokens: 0.5 * 3.25 / 5 = 0.325
    loss, _, grad = _value_loss(orl, denominators=Denominators(tokens=5.0, seqs=3.0,
                                                               norm_len=2.0))
    assert loss.item() == pytest.approx(0.325)
    torch.testing.assert_close(grad, torch.tensor([[0.0, 0.02]], dtype=torch.float64))
