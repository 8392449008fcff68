"""The local Ray cluster of ``--executor ray`` listens on loopback only: the GCS, the raylet,
the agents, the workers and the rank groups' sockets, listed from the OS while it is up."""

from __future__ import annotations

import ipaddress
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent

pytestmark = pytest.mark.slow


def _loopback(addr: str) -> bool:
    ip = ipaddress.ip_address(addr.rsplit(":", 1)[0])
    mapped = getattr(ip, "ipv4_mapped", None)  # ::ffff:127.0.0.1, an IPv6 socket on IPv4 loopback
    return (mapped or ip).is_loopback


def test_every_process_of_the_local_ray_cluster_listens_on_loopback_only():
    pytest.importorskip("ray")
    pytest.importorskip("psutil")
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0",
               PYTHONPATH=os.pathsep.join([str(REPO), str(HERE), os.environ.get("PYTHONPATH", "")]))
    env.pop("RAY_ADDRESS", None)
    driver = subprocess.run([sys.executable, str(HERE / "ray_listen_driver.py")], cwd=REPO,
                            env=env, capture_output=True, text=True, timeout=600)
    assert driver.returncode == 0, driver.stderr[-3000:]
    seen = json.loads(driver.stdout.strip().splitlines()[-1])
    names = " ".join(seen)
    assert "gcs_server" in names and "raylet" in names, seen  # the cluster's own servers
    assert sum(len(a) for a in seen.values()) >= 5, seen
    exposed = {proc: [a for a in addrs if not _loopback(a)] for proc, addrs in seen.items()}
    assert not any(exposed.values()), {p: a for p, a in exposed.items() if a}
