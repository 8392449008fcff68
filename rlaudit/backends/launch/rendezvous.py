"""Where a launch listens: its rendezvous store and its ranks' gloo/NCCL sockets bind to one
address, loopback by default (every rank of a launch is a local process).

torch's ``TCPStore`` server listens on every interface (``::``) whatever host name it is given,
and it is unauthenticated: anyone who can reach the port can join or poison a process group. So
the launcher binds the listening socket itself, to ``host`` only, and hands its file descriptor
to the store (``master_listen_fd``; the store owns and closes it). The ranks' collective sockets
are pinned to the interface that carries ``host`` (``GLOO_SOCKET_IFNAME``, and
``NCCL_SOCKET_IFNAME`` for NCCL's bootstrap), instead of whatever address the machine's host
name resolves to (on a cluster node: its public one).

A multi-node setup passes an explicit ``host``: this node's address on the interface the other
nodes reach. A wildcard address (``0.0.0.0``, ``::``) is refused.
"""

from __future__ import annotations

import fcntl
import ipaddress
import os
import socket
import struct
from datetime import timedelta

from rlaudit.errors import InputError

#: the default: every rank is a local process
LOOPBACK = "127.0.0.1"
#: ioctl number of SIOCGIFADDR (linux/sockios.h): an interface's IPv4 address
_SIOCGIFADDR = 0x8915
_SOURCE = "launch()"


def check_host(host: str) -> str:
    """``host`` as an IPv4 address string; InputError for a wildcard or an unresolvable name."""
    try:
        addr = socket.gethostbyname(host)
    except (OSError, UnicodeError) as e:
        raise InputError(f"cannot resolve {host!r}: {e}", source=_SOURCE, key="host") from None
    if ipaddress.ip_address(addr).is_unspecified:
        raise InputError(f"{host!r} listens on every interface; give the one address the ranks "
                         f"use ({LOOPBACK} on a single host)", source=_SOURCE, key="host")
    return addr


def interface_of(addr: str) -> str | None:
    """Name of the network interface holding IPv4 ``addr`` (Linux; None when not found)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                raw = fcntl.ioctl(s.fileno(), _SIOCGIFADDR,
                                  struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue  # no IPv4 address on this interface
            if socket.inet_ntoa(raw[20:24]) == addr:
                return name
    return None


def rank_socket_env(addr: str, *, backend: str) -> dict[str, str]:
    """Environment that makes a rank's collective sockets bind to the interface of ``addr``."""
    name = interface_of(addr)
    if name is None:
        if ipaddress.ip_address(addr).is_loopback:
            return {}  # no interface listing here: gloo falls back to loopback by itself
        raise InputError(f"no network interface of this machine has the address {addr}",
                         source=_SOURCE, key="host")
    env = {"GLOO_SOCKET_IFNAME": name}
    if backend == "nccl":
        env["NCCL_SOCKET_IFNAME"] = name
    return env


def rendezvous_store(addr: str, *, timeout: float):
    """A ``TCPStore`` server listening on ``addr`` only, on a free port (``store.port``); the
    port stays held until the store is deleted."""
    # lazy: rank processes import this module before torch (env first)
    import torch.distributed as dist

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind((addr, 0))
        sock.listen(socket.SOMAXCONN)
    except OSError as e:
        sock.close()
        raise InputError(f"cannot listen on {addr}: {e}", source=_SOURCE, key="host") from None
    port = sock.getsockname()[1]
    fd = sock.detach()  # the store owns the descriptor from here on
    try:
        return dist.TCPStore(addr, port, None, is_master=True, timeout=timedelta(seconds=timeout),
                             wait_for_workers=False, master_listen_fd=fd)
    except BaseException:
        os.close(fd)
        raise
