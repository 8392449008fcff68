"""AReaL through `rlaudit run --target areal`, and its stages on hand-worked examples.

AReaL 1.0.4 (requirements/peers/areal-1.0.4.txt, `make peers`) must exit 0 with only its declared
differences. AReaL PR #1346 (https://github.com/areal-project/AReaL/pull/1346) fixed GSPO's
per-sequence advantage on padded (2D) batches: it averaged every position's advantage, masked
padding included, so values under ``loss_mask=False`` changed the loss and gradients of valid
tokens. The git tag v1.0.4 still has the old lines
(https://github.com/inclusionAI/AReaL/blob/v1.0.4/areal/utils/functional/functional.py#L143-L145);
the 1.0.4 wheel on the package index was built after the fix, so no installable release carries
the bug: it is patched back in here, and ``policy_loss:masked-values`` must fail on GSPO only.
"""

from __future__ import annotations

import textwrap

import pytest
import torch
from peer_cli import run_cli, statuses

from rlaudit.targets import peers

PINNED = "1.0.4"


def _installed() -> None:
    path = peers.peers_dir() / f"areal-{PINNED}"
    if not (path / "areal" / "__init__.py").is_file():
        pytest.skip(f"areal=={PINNED} is not installed under {peers.peers_dir()} (run `make "
                    f"peers`, docs/peers.md)")


@pytest.fixture(scope="module")
def areal():
    _installed()
    peers.activate("areal", PINNED)
    from rlaudit.targets.peers.areal import ArealAdapter  # lazy: needs the peer on the path
    return ArealAdapter()


#: the 2D branch of _compute_sequence_level_ratio_and_advantages before PR #1346: the sequence
#: advantage is the sum over every position divided by the valid count, and stays on padding
PRE_1346 = textwrap.dedent(f"""
    import sys
    from rlaudit.targets import peers
    peers.activate("areal", "{PINNED}")
    from rlaudit.targets.peers.areal import import_areal
    import_areal()
    import areal.utils.functional.functional as fn
    fixed = fn._compute_sequence_level_ratio_and_advantages

    def pre_1346(log_ratio, advantages, loss_mask, cu_seqlens):
        ratio, _ = fixed(log_ratio, advantages, loss_mask, cu_seqlens)
        seq_lengths = loss_mask.sum(dim=-1, keepdim=True).clamp(min=1)
        return ratio, (advantages.sum(dim=-1, keepdim=True) / seq_lengths).expand_as(log_ratio)

    fn._compute_sequence_level_ratio_and_advantages = pre_1346
    from rlaudit.cli.main import main
    sys.exit(main(sys.argv[1:]))
""")


@pytest.mark.slow
def test_pinned_release_passes_with_only_declared_differences(tmp_path):
    _installed()
    rc, checks, err = run_cli(tmp_path, f"areal=={PINNED}")
    got = statuses(checks)
    assert {n for n, s in got.items() if s in ("fail", "error")} == set(), \
        {n: checks[n]["message"] for n, s in got.items() if s in ("fail", "error")}
    assert rc == 0, err[-2000:]
    for name in ("kl_penalty:parity", "compute_advantages:row-permutation",
                 "compute_advantages:masked-values", "policy_loss:masked-values",
                 "policy_loss:row-permutation", "policy_loss:clip-effect"):
        assert got[name] == "pass", (name, checks[name]["message"])
    assert set(checks["compute_advantages:parity"]["details"]["differences"]) == {
        "normalise-by-std-plus-eps", "singleton-group-mean-is-itself",
        "baseline-returns-before-normalisation"}
    assert set(checks["policy_loss:parity"]["details"]["differences"]) == {
        "gspo-sequence-mean-advantage"}


@pytest.mark.slow
def test_gspo_padding_advantage_bug_is_red(tmp_path):
    _installed()
    rc, checks, _ = run_cli(tmp_path, f"areal=={PINNED}", driver=PRE_1346)
    failed = {n for n, s in statuses(checks).items() if s in ("fail", "error")}
    assert rc == 1
    assert failed == {"policy_loss:masked-values"}
    problems = checks["policy_loss:masked-values"]["details"]["problems"]
    assert problems and all(p.startswith("gspo/") for p in problems), problems


def test_grpo_normalises_each_uid_group(areal):
    # uid 5 rows 0 and 2 (scores 1, 0), uid 8 rows 1 and 3 (2, 0): (x - mean) / (std + 1e-5),
    # std unbiased = |a - b| / sqrt(2): rows get +-0.5 / (0.70711 + 1e-5) and
    # +-1 / (1.41421 + 1e-5) = +-0.70710 (to 1e-5)
    rewards = torch.zeros(4, 3, dtype=torch.float64)
    rewards[:, 2] = torch.tensor([1.0, 2.0, 0.0, 0.0])
    adv, _ = areal.compute_advantages(
        estimator="grpo", token_level_rewards=rewards, response_mask=torch.ones(4, 3, dtype=bool),
        uid=torch.tensor([5, 8, 5, 8]))
    a = 0.5 / (2 ** -0.5 + 1e-5)
    b = 1.0 / (2 ** 0.5 + 1e-5)
    want = torch.tensor([a, b, -a, -b]).unsqueeze(1).expand(4, 3)
    torch.testing.assert_close(adv, want.float(), rtol=1e-6, atol=1e-6)


def test_reinforce_skips_masked_positions(areal):
    # rewards [1, 5, 2], mask [1, 0, 1], gamma 0.5: the masked position is skipped (its reward
    # never read, no discount step): returns G2 = 2, G0 = 1 + 0.5 * 2 = 2
    _, ret = areal.compute_advantages(
        estimator="reinforce_plus_plus",
        token_level_rewards=torch.tensor([[1.0, 5.0, 2.0]], dtype=torch.float64),
        response_mask=torch.tensor([[True, False, True]]), uid=torch.tensor([0]), gamma=0.5)
    assert ret[0, 0].item() == pytest.approx(2.0)
    assert ret[0, 2].item() == pytest.approx(2.0)


def test_dual_clip_caps_a_negative_advantage(areal):
    # A = -1, log ratio 1.5: the clipped loss 4.48 is capped at c * |A| = 3; gradient 0
    logp = torch.tensor([[-0.5, -1.0]], dtype=torch.float64, requires_grad=True)
    loss, _ = areal.policy_loss(
        old_log_prob=torch.tensor([[-2.0, -1.0]], dtype=torch.float64), log_prob=logp,
        advantages=torch.tensor([[-1.0, 7.0]], dtype=torch.float64),
        response_mask=torch.tensor([[True, False]]), loss_mode="vanilla",
        loss_agg_mode="token-mean", clip_ratio_low=0.2, clip_ratio_high=0.2, clip_ratio_c=3.0)
    assert loss.item() == pytest.approx(3.0)
    loss.backward()
    assert logp.grad.abs().sum().item() == 0.0
