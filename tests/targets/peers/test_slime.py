"""slime through `rlaudit run --target slime`, as a user runs it (a subprocess of the CLI).

The two snapshots in ../shared/peers/slime/ (or $RLAUDIT_SLIME_DIR): 624b824a8, after slime
PR #2114, passes with its declared conventions; a0d6d26a2, its parent, shapes the reward in place
on the stored KL and fails `apply_kl_in_reward:stored-kl-unaltered`, and nothing else.
"""

from __future__ import annotations

import pytest
from peer_cli import run_cli, statuses

from rlaudit.errors import InputError
from rlaudit.targets import peers

AFTER, BEFORE = "624b824a8", "a0d6d26a2"


def _snapshot(commit: str) -> None:
    try:
        peers.source_snapshot("slime", commit)
    except InputError as e:
        pytest.skip(f"slime snapshot absent: {e}")


@pytest.mark.slow
def test_slime_after_2114_passes(tmp_path):
    _snapshot(AFTER)
    rc, checks, err = run_cli(tmp_path, f"slime=={AFTER}")
    got = statuses(checks)
    assert {n for n, s in got.items() if s in ("fail", "error")} == set(), \
        {n: checks[n]["message"] for n, s in got.items() if s in ("fail", "error")}
    assert rc == 0, err[-2000:]
    assert got["apply_kl_in_reward:stored-kl-unaltered"] == "pass"
    assert got["apply_kl_in_reward:parity"] == "pass"
    assert got["apply_kl_in_reward:no-mutation"] == "pass"
    assert got["kl_penalty:parity"] == "pass"
    assert got["policy_loss:masked-values"] == "pass"
    # declared, without a reference convention: the per-token normaliser counting an empty
    # sample as one token (token-mean, ragged); the per-sample mean over every sample
    # (seq_count) and GSPO's sequence-level gradient (gspo_gradient) are conventions: strict
    assert got["policy_loss:parity"] == "differs"
    assert set(checks["policy_loss:parity"]["details"]["differences"]) == {
        "per-token-normaliser-counts-empty-samples"}
    assert set(checks["policy_loss:global-split"]["details"]["differences"]) == {
        "per-token-normaliser-counts-empty-samples"}


@pytest.mark.slow
def test_slime_before_2114_fails_stored_kl_unaltered_only(tmp_path):
    _snapshot(BEFORE)
    rc, checks, _ = run_cli(tmp_path, f"slime=={BEFORE}")
    failed = {n for n, c in checks.items() if c["status"] in ("fail", "error")}
    assert rc == 1
    # the one bug, seen by both KL-in-reward checks: the stored KL was overwritten with the
    # shaped reward, so it is neither the KL estimate nor what the rewards were built from
    assert failed == {"apply_kl_in_reward:stored-kl-unaltered",
                      "apply_kl_in_reward:rewards-from-stored-kl"}
    assert "stored kl" in checks["apply_kl_in_reward:stored-kl-unaltered"]["message"]


def _fake_slime(root) -> None:
    (root / "slime").mkdir(parents=True)
    (root / "slime" / "__init__.py").write_text("")


def test_snapshot_lookup_order_and_errors(tmp_path, monkeypatch):
    """$RLAUDIT_SLIME_DIR (a checkout, or a folder of <commit>/), then <peers dir>/slime-<commit>;
    a missing one is an input error naming every place looked at."""
    monkeypatch.setenv("RLAUDIT_PEERS_DIR", str(tmp_path / "peers"))
    monkeypatch.delenv("RLAUDIT_SLIME_DIR", raising=False)
    with pytest.raises(InputError) as e:
        peers.source_snapshot("slime", "abc1234")
    assert str(tmp_path / "peers" / "slime-abc1234") in str(e.value)
    _fake_slime(tmp_path / "peers" / "slime-abc1234")
    assert peers.source_snapshot("slime", "abc1234") == (tmp_path / "peers" / "slime-abc1234",
                                                          "abc1234")
    _fake_slime(tmp_path / "snaps" / "abc1234")
    monkeypatch.setenv("RLAUDIT_SLIME_DIR", str(tmp_path / "snaps"))
    assert peers.source_snapshot("slime", "abc1234") == (tmp_path / "snaps" / "abc1234",
                                                          "abc1234")
    _fake_slime(tmp_path / "fork")
    monkeypatch.setenv("RLAUDIT_SLIME_DIR", str(tmp_path / "fork"))
    assert peers.source_snapshot("slime") == (tmp_path / "fork", "fork")
    with pytest.raises(InputError, match="one slime checkout"):
        peers.source_snapshot("slime", "abc1234")
    assert peers.parse("slime==a0d6d26a2") == ("slime", "a0d6d26a2")
