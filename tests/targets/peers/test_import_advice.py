"""A peer that cannot import: the advice names what is wrong and what would fix it."""

from __future__ import annotations

from rlaudit.targets.peers.registry import import_advice


def test_a_missing_package_is_make_peers_job():
    msg = import_advice(ModuleNotFoundError("No module named 'tensordict'", name="tensordict"))
    assert msg.endswith("(run `make peers`, see docs/peers.md)")


def test_a_name_the_environments_package_lacks_is_not():
    # as transformers 5 says it to a release written for transformers 4
    e = ImportError("cannot import name 'AutoModelForVision2Seq' from 'json' (/x/json.py)",
                    name="json")
    msg = import_advice(e)
    assert "the environment's json has no 'AutoModelForVision2Seq'" in msg
    assert "needs an older json" in msg and "`make peers` does not install" in msg
    assert "run `make peers`" not in msg


def test_a_name_missing_from_the_peer_itself_keeps_the_install_advice():
    e = ImportError("cannot import name 'agg_loss' from 'verl.trainer' (/x.py)", name="verl")
    assert import_advice(e).endswith("(run `make peers`, see docs/peers.md)")
