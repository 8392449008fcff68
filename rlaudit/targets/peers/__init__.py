"""First-party adapters over other projects' real, installed code (one module per peer).

    rlaudit run --target verl            # the verl found on sys.path, else the newest under .peers/
    rlaudit run --target verl==0.7.1     # <peers dir>/verl-0.7.1 (made by `make peers`)
    rlaudit run --target slime==a0d6d26a2  # a slime source snapshot (not on the package index)

- ``registry.py``: the short names, where a peer's install or source snapshot is found, and
  putting it on ``sys.path``.
- ``verl.py``, ``skyrl.py``, ``slime.py``, ``trl.py``: the adapters (each imports its peer only
  when used).
- ``install.py``: ``make peers`` (``python -m rlaudit.targets.peers.install``).

docs/peers.md says what each covers per version.
"""

from rlaudit.targets.peers.registry import (MODULES, PEERS, SNAPSHOT_PEERS, activate,
                                            installed_versions, parse, peers_dir, resolve,
                                            source_snapshot)

__all__ = ["MODULES", "PEERS", "SNAPSHOT_PEERS", "activate", "installed_versions", "parse",
           "peers_dir", "resolve", "source_snapshot"]
