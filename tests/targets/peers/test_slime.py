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
    assert got["policy_loss:parity"] == "differs"       # declared: denominators, GSPO gradient


@pytest.mark.slow
def test_slime_before_2114_fails_stored_kl_unaltered_only(tmp_path):
    _snapshot(BEFORE)
    rc, checks, _ = run_cli(tmp_path, f"slime=={BEFORE}")
    failed = {n for n, c in checks.items() if c["status"] in ("fail", "error")}
    assert rc == 1
    assert failed == {"apply_kl_in_reward:stored-kl-unaltered"}
    assert "stored kl" in checks["apply_kl_in_reward:stored-kl-unaltered"]["message"]
