"""The launcher listens on loopback only (issue #13 case 6): its rendezvous store (torch's
TCPStore alone listens on every interface, unauthenticated) and its ranks' gloo sockets."""

from __future__ import annotations

import ipaddress
import os
import socket
import sys

import pytest

from rlaudit.backends.launch import rendezvous, launch
from rlaudit.errors import InputError

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="reads listening sockets from /proc (Linux)")


def listening_addresses(pid: int) -> list[str]:
    """Local addresses of the TCP sockets process ``pid`` listens on (from /proc)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    out = []
    for table in ("tcp", "tcp6"):
        for line in open(f"/proc/net/{table}").read().splitlines()[1:]:
            fields = line.split()
            if fields[3] != "0A" or fields[9] not in inodes:  # 0A: LISTEN
                continue
            hexaddr, port = fields[1].split(":")
            raw = bytes.fromhex(hexaddr)
            # /proc stores each 32-bit word in host (little-endian) order
            raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
            addr = ipaddress.ip_address(raw)
            if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped:
                addr = addr.ipv4_mapped
            out.append(f"{addr}:{int(port, 16)}")
    return out


def _listening_in_rank(info):
    import torch
    import torch.distributed as dist
    x = torch.ones(1)
    dist.all_reduce(x)  # the gloo pairs are connected
    return {"listen": listening_addresses(os.getpid()),
            "ifname": os.environ.get("GLOO_SOCKET_IFNAME")}


def test_the_rendezvous_store_listens_on_loopback_only():
    before = set(listening_addresses(os.getpid()))
    store = rendezvous.rendezvous_store(rendezvous.LOOPBACK, timeout=30)
    port = store.port
    new = set(listening_addresses(os.getpid())) - before
    assert new == {f"127.0.0.1:{port}"}  # not 0.0.0.0 / :: (every interface)
    store.set("k", "v")
    assert store.get("k") == b"v"
    del store  # the store owns the listening socket and closes it
    assert f"127.0.0.1:{port}" not in listening_addresses(os.getpid())


def test_the_unpatched_torch_store_would_listen_everywhere():
    """What the fix is for (if torch ever binds the host it is given, this documents it)."""
    import datetime

    import torch.distributed as dist
    store = dist.TCPStore("127.0.0.1", 0, None, is_master=True,
                          timeout=datetime.timedelta(seconds=30), wait_for_workers=False)
    try:
        mine = [a for a in listening_addresses(os.getpid()) if a.endswith(f":{store.port}")]
        assert mine and not all(a.startswith("127.") for a in mine)
    finally:
        del store


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "no-such-host.invalid"])
def test_a_wildcard_or_unknown_host_is_refused(host):
    with pytest.raises(InputError) as e:
        launch(_listening_in_rank, 1, host=host)
    assert e.value.key == "host"


def test_an_address_this_machine_does_not_have_is_refused():
    with pytest.raises(InputError, match="no network interface"):
        rendezvous.rank_socket_env("192.0.2.1", backend="gloo")  # TEST-NET-1


@pytest.mark.slow
def test_every_socket_of_a_launch_and_of_a_warm_pool_listens_on_loopback():
    from rlaudit.backends.launch.pool import run_ranks, warm_pools
    before = set(listening_addresses(os.getpid()))
    with warm_pools():
        pooled = run_ranks(_listening_in_rank, 2, pool="loopback-test", timeout=120)
        # the pool's rendezvous store, held open in this process while the pool lives
        held = set(listening_addresses(os.getpid())) - before
        assert held and all(a.startswith("127.") for a in held), held
    for r in [*launch(_listening_in_rank, 2, timeout=120), *pooled]:
        assert r["listen"], r  # gloo listens for its pairs ...
        assert all(a.startswith("127.") for a in r["listen"]), r  # ... on loopback only
        assert r["ifname"] == rendezvous.interface_of("127.0.0.1")
    assert socket.gethostbyname("localhost").startswith("127.")
