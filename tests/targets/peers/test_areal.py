"""AReaL through `rlaudit run --target areal`, and its stages on hand-worked examples.

AReaL 1.0.4 (requirements/peers/areal-1.0.4.txt, `make peers`) must exit 0 with only its declared
differences. AReaL PR #1346 (https://github.com/areal-project/AReaL/pull/1346) fixed GSPO's
per-sequence advantage on padded (2D) batches: it averaged every position's advantage, masked
padding included, so values under ``loss_mask=False`` changed the loss and gradients of valid
tokens. The git tag v1.0.4 still has the old lines
(https://github.com/inclusionAI/AReaL/blob/v1.0.4/areal/utils/functional/functional.py#L143-L145);
the 1.0.4 wheel on the package index was built after the fix, so no installable release carries
the bug: it is patched back in here, and ``policy_loss:masked-values`` must fail on GSPO only.
Everything runs in subprocesses: importing AReaL replaces ``logging.root`` (areal_probe.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from peer_cli import run_cli, statuses

from rlaudit.targets import peers

PINNED = "1.0.4"
#: every test imports the peer (20-45 s) or runs the CLI over it
pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[3]
PROBE = Path(__file__).with_name("areal_probe.py")
TRAIN_PROBE = Path(__file__).with_name("areal_train_probe.py")


def _installed() -> None:
    path = peers.peers_dir() / f"areal-{PINNED}"
    if not (path / "areal" / "__init__.py").is_file():
        pytest.skip(f"areal=={PINNED} is not installed under {peers.peers_dir()} (run `make "
                    f"peers`, docs/peers.md)")


@pytest.fixture(scope="module")
def probe(tmp_path_factory):
    """areal_probe.py's outputs (hand-worked inputs through the adapter, in its own process)."""
    _installed()
    out = tmp_path_factory.mktemp("areal") / "probe.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]))
    proc = subprocess.run([sys.executable, str(PROBE), PINNED, str(out)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


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


def test_pinned_release_passes_with_only_declared_differences(tmp_path):
    _installed()
    rc, checks, err = run_cli(tmp_path, f"areal=={PINNED}")
    got = statuses(checks)
    assert {n for n, s in got.items() if s in ("fail", "error")} == set(), \
        {n: checks[n]["message"] for n, s in got.items() if s in ("fail", "error")}
    assert rc == 0, err[-2000:]
    for name in ("kl_penalty:parity", "compute_advantages:row-permutation", "value_loss:parity",
                 "compute_advantages:masked-values", "policy_loss:masked-values",
                 "policy_loss:row-permutation", "policy_loss:clip-effect"):
        assert got[name] == "pass", (name, checks[name]["message"])
    assert set(checks["compute_advantages:parity"]["details"]["differences"]) == {
        "normalise-by-std-plus-eps", "singleton-group-mean-is-itself",
        "baseline-returns-before-normalisation"}
    assert set(checks["policy_loss:parity"]["details"]["differences"]) == {
        "gspo-sequence-mean-advantage"}


def test_gspo_padding_advantage_bug_is_red(tmp_path):
    _installed()
    rc, checks, _ = run_cli(tmp_path, f"areal=={PINNED}", driver=PRE_1346)
    failed = {n for n, s in statuses(checks).items() if s in ("fail", "error")}
    assert rc == 1
    assert failed == {"policy_loss:masked-values"}
    problems = checks["policy_loss:masked-values"]["details"]["problems"]
    assert problems and all(p.startswith("gspo/") for p in problems), problems


def test_grpo_normalises_each_uid_group(probe):
    # uid 5 rows 0 and 2 (scores 1, 0), uid 8 rows 1 and 3 (2, 0): (x - mean) / (std + 1e-5),
    # std unbiased = |a - b| / sqrt(2): rows get +-0.5 / (0.70711 + 1e-5) and
    # +-1 / (1.41421 + 1e-5) = +-0.70710 (to 1e-5)
    a = 0.5 / (2 ** -0.5 + 1e-5)
    b = 1.0 / (2 ** 0.5 + 1e-5)
    want = torch.tensor([a, b, -a, -b], dtype=torch.float64).unsqueeze(1).expand(4, 3)
    torch.testing.assert_close(torch.tensor(probe["grpo_adv"], dtype=torch.float64), want,
                               rtol=1e-6, atol=1e-6)


def test_reinforce_skips_masked_positions(probe):
    # rewards [1, 5, 2], mask [1, 0, 1], gamma 0.5: the masked position is skipped (its reward
    # never read, no discount step): returns G2 = 2, G0 = 1 + 0.5 * 2 = 2
    assert probe["rfpp_returns"] == pytest.approx([2.0, 2.0])


def test_dual_clip_caps_a_negative_advantage(probe):
    # A = -1, log ratio 1.5: the clipped loss 4.48 is capped at c * |A| = 3, gradient 0; the
    # second token is masked (its advantage 7 never counts)
    assert probe["dual_clip_loss"] == pytest.approx(3.0)
    assert probe["dual_clip_grad"] == [[0.0, 0.0]]


def test_unequal_groups_are_not_supported_rather_than_wrong(probe):
    assert "same size" in probe["unequal_groups"]


#: the critic's loss on a hand-worked example, in a process of its own (module docstring):
#: token 0 moves 1.0 from its old value (outside a 0.2 window), token 1 moves 0.1 (inside it),
#: token 2 is masked (its move and return never count)
VALUE_PROBE = textwrap.dedent(f"""
    import json, sys, warnings
    import torch
    warnings.filterwarnings("ignore")
    from rlaudit.targets import peers
    peers.activate("areal", "{PINNED}")
    from rlaudit.targets.peers.areal import ArealAdapter
    vpred = torch.tensor([[1.0, 0.1, 5.0]], dtype=torch.float64, requires_grad=True)
    loss, metrics = ArealAdapter().value_loss(
        vpreds=vpred, values=torch.zeros(1, 3, dtype=torch.float64),
        returns=torch.tensor([[2.0, 0.0, -3.0]], dtype=torch.float64),
        response_mask=torch.tensor([[True, True, False]]), cliprange_value=0.2,
        loss_agg_mode="token-mean")
    loss.backward()
    json.dump({{"loss": float(loss), "metrics": metrics, "grad": vpred.grad.tolist()}},
              sys.stdout)
""")


def test_value_loss_clips_around_the_old_values_with_a_half():
    _installed()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]))
    proc = subprocess.run([sys.executable, "-c", VALUE_PROBE], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    # token 0: unclipped (1 - 2)^2 = 1, clipped around V = 0: (0.2 - 2)^2 = 3.24, the larger
    # (clipped: gradient 0); token 1: both (0.1 - 0)^2 = 0.01, gradient 0.5 * 2 * 0.1 / 2 =
    # 0.05. Loss 0.5 * (3.24 + 0.01) / 2 valid tokens = 0.8125; clip fraction 1 / 2
    assert got["loss"] == pytest.approx(0.8125, rel=1e-6)
    assert got["grad"][0] == pytest.approx([0.0, 0.05, 0.0], abs=1e-7)
    assert got["metrics"]["critic/vf_clipfrac"] == pytest.approx(0.5)


def test_own_update_runs_on_cpu_and_raises_rewarded_log_probs(tmp_path):
    # AReaL's FSDP engine and PPOActor._ppo_update on its CPU platform (areal_train_probe.py):
    # one SGD step on a loss whose every advantage is +1 must raise the mean log-prob of the
    # trained tokens (first order: lr * |grad|^2 > 0); a sign error would lower it
    _installed()
    out = tmp_path / "train.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]))
    model = REPO / "scenarios" / "models" / "qwen2-tiny"
    proc = subprocess.run([sys.executable, str(TRAIN_PROBE), PINNED, str(model), str(out)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(out.read_text())
    assert got["device"] == "cpu"
    assert got["advantages"] == [1.0, 1.0]
    assert got["after"] > got["before"] + 1e-3, got
