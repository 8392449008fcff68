"""SkyRL through `rlaudit run --target skyrl`, as a user runs it (a subprocess of the CLI).

SkyRL 0.4.0 (requirements/peers/skyrl-0.4.0.txt, installed by `make peers`) must pass with its
declared conventions; the same release with the padding micro-batches of before SkyRL's fix
(PR #1811, merged as #1815: a padding micro-batch kept only a hard-coded key list, so
`rollout_logprobs` was missing on it) must fail `make_microbatches:padding-complete`, naming the
field, and nothing else.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
from peer_cli import run_cli, statuses

from rlaudit.targets import peers
from rlaudit.targets.peers.skyrl_train import TRAINER_IMPORTS

VERSION = "0.4.0"


def _skyrl_dir() -> Path:
    path = peers.peers_dir() / f"skyrl-{VERSION}"
    if not (path / "skyrl" / "__init__.py").is_file():
        pytest.skip(f"skyrl=={VERSION} is not installed under {peers.peers_dir()} (run `make "
                    f"peers`, docs/peers.md)")
    return path


#: SkyRL before PR #1811/#1815 (upstream commit 43b662f07^, worker_utils.py): a padding
#: micro-batch held exactly these keys, whatever the real data carried
PRE_1811_KEYS = ("sequences", "attention_mask", "action_log_probs", "base_action_log_probs",
                 "values", "returns", "advantages", "loss_mask", "response_mask")

PRE_1811 = textwrap.dedent(f"""
    import sys
    from rlaudit.targets import peers
    peers.activate("skyrl", "{VERSION}")
    from rlaudit.targets.peers.skyrl import import_skyrl
    iterator = import_skyrl().workers.TokenBasedBatchIterator
    fixed = iterator._create_padding_microbatch

    def pre_1811(self):
        mb = fixed(self)
        for key in [k for k in mb if k not in {PRE_1811_KEYS!r}]:
            del mb[key]
        return mb

    iterator._create_padding_microbatch = pre_1811
    from rlaudit.cli.main import main
    sys.exit(main(sys.argv[1:]))
""")


@pytest.mark.slow
def test_skyrl_0_4_0_passes_with_its_conventions_declared(tmp_path):
    path = _skyrl_dir()
    rc, checks, err = run_cli(tmp_path, f"skyrl=={VERSION}")
    got = statuses(checks)
    assert {n for n, s in got.items() if s in ("fail", "error")} == set(), \
        {n: checks[n]["message"] for n, s in got.items() if s in ("fail", "error")}
    assert rc == 0, err[-2000:]
    # what ran and how it came out
    assert got["kl_penalty:parity"] == "pass"
    assert got["make_microbatches:tokens-exactly-once"] == "pass"
    assert got["make_microbatches:equal-count-per-rank"] == "pass"
    # padding micro-batches hold extra placeholders for fields real ones hold as None: harmless,
    # and nothing real ones carry is missing
    assert got["make_microbatches:padding-complete"] == "pass"
    assert got["policy_loss:row-permutation"] == "pass"
    assert got["policy_loss:masked-values"] == "pass"
    assert got["policy_loss:global-split"] == "n/a"     # SkyRL scales per mini-batch it holds
    # N_seq over every row (sequence_mean, seq_mean_token_sum_norm): a declared convention the
    # reference computes too, so the check is strict and passes
    assert got["policy_loss:parity"] == "pass"
    # the two differences without a reference convention: reported as differs, naming them
    assert got["compute_advantages:parity"] == "differs"
    assert set(checks["compute_advantages:parity"]["details"]["differences"]) == {
        "rloo-singleton-zero", "recursions-through-loss-masked-tokens"}
    assert got["agg_loss:parity"] == "n/a"
    # train_step: SkyRL's own worker and trainer on CPU (skyrl_train), when the peer directory
    # holds what they import; else unsupported with the reason, never an error
    if all((path / m).is_dir() for m in TRAINER_IMPORTS):
        assert got["train_step:no-input-mutation"] == "pass"
        assert got["backend-parity"] == "pass" and got["grad-norm-identity"] == "pass"
    else:
        assert got["backend-parity"] == "n/a"


@pytest.mark.slow
def test_skyrl_with_pre_1811_padding_fails_padding_complete_naming_the_field(tmp_path):
    _skyrl_dir()
    rc, checks, _ = run_cli(tmp_path, f"skyrl=={VERSION}", driver=PRE_1811)
    failed = {n for n, c in checks.items() if c["status"] in ("fail", "error")}
    assert rc == 1
    # padding-complete, and independently the loss over the micro-batches (issue #12 item 6)
    assert failed == {"make_microbatches:padding-complete", "make_microbatches:loss-sums-to-batch"}
    msg = checks["make_microbatches:padding-complete"]["message"]
    assert "rollout_log_probs" in msg, msg
