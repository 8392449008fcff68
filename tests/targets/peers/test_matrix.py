"""The release matrix's table on hand-built audit results: states, reds linked to their upstream
bug only on the releases it affects, untraced reds named, a release that does not import shown."""

from __future__ import annotations

from rlaudit.targets.peers.known_reds import traced, version_key
from rlaudit.targets.peers.matrix import Release, markdown


def test_versions_compare_as_numbers():
    assert version_key("0.10.0") > version_key("0.9.1") > version_key("0.9.0")
    assert version_key("0.9.1+fork") == version_key("0.9.1")


def test_a_known_red_covers_only_the_releases_before_its_fix():
    check = "make_microbatches:within-token-budget"
    assert traced("verl", "0.9.0", check).link.endswith("/pull/7553")
    assert traced("verl", "0.9.1", check) is None
    assert traced("skyrl", "0.1.0", check) is None            # another peer
    assert traced("slime", "a0d6d26a2", "apply_kl_in_reward:stored-kl-unaltered")
    assert traced("slime", "624b824a8", "apply_kl_in_reward:stored-kl-unaltered") is None


def _found(statuses: dict) -> dict:
    return {"checks": {k: {"status": v, "message": f"{k} said so"} for k, v in statuses.items()}}


def test_markdown_table_links_reds_and_names_the_rest():
    rows = [
        (Release("verl", "0.8.0"), _found({"make_microbatches:within-token-budget": "fail",
                                           "agg_loss:global-split": "pass",
                                           "kl_penalty:parity": "fail"})),
        (Release("verl", "0.9.1"), _found({"make_microbatches:within-token-budget": "pass",
                                           "agg_loss:global-split": "unsupported",
                                           "kl_penalty:parity": "pass"})),
        (Release("verl", "0.6.1"), {"error": "cannot import name 'X' from 'transformers'"}),
    ]
    text = markdown(rows, date="2026-11-28", command="make peers-matrix")
    lines = text.splitlines()
    row = next(ln for ln in lines if ln.startswith("| `make_microbatches:within-token-budget`"))
    assert row == ("| `make_microbatches:within-token-budget` | **FAIL** "
                   "[link](https://github.com/verl-project/verl/pull/7553) | pass | - |")
    assert "| `agg_loss:global-split` | pass | unsupported | - |" in lines
    assert "| `kl_penalty:parity` | **FAIL** untraced | pass | - |" in lines
    assert "cannot import name 'X' from 'transformers'" in text
    assert "- verl==0.8.0 `kl_penalty:parity`: untraced: kl_penalty:parity said so" in lines
