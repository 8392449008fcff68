"""A Ray cluster address checked before ``ray.init`` joins it.

``ray.init(address="host:port")`` with nothing listening there retries its GCS connection for
minutes; ``rlaudit run --executor ray --ray-address ADDR`` instead tries one TCP connection
(:data:`CONNECT_TIMEOUT_S`) and stops with the address named when it is refused or times out.

    probe_ray_address("ray://head:10001", flag="--ray-address")
"""

from __future__ import annotations

import socket

from rlaudit.errors import InputError

#: seconds one TCP connection to the cluster may take before the address counts as unreachable
CONNECT_TIMEOUT_S = 5.0
#: Ray's default ports: the GCS of ``host:port`` addresses, the client server of ``ray://``
GCS_PORT, CLIENT_PORT = 6379, 10001
#: addresses Ray resolves itself (a file on this node, or a new local cluster): nothing to probe
LOCAL_ADDRESSES = ("auto", "local", "")


def host_port(address: str) -> tuple[str, int]:
    """``[ray://]host[:port]`` -> (host, port); InputError when it is not of that form."""
    client = address.startswith("ray://")
    rest = address[len("ray://"):] if client else address
    rest = rest.split("/", 1)[0]
    if rest.startswith("["):  # [IPv6]:port
        host, _, tail = rest[1:].partition("]")
        port_text = tail[1:] if tail.startswith(":") else ""
    else:
        host, _, port_text = rest.rpartition(":") if ":" in rest else (rest, "", "")
    if not host:
        raise InputError(f"expected [ray://]HOST[:PORT], auto or local, got {address!r}")
    if not port_text:
        return host, CLIENT_PORT if client else GCS_PORT
    if not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise InputError(f"port {port_text!r} of {address!r} is not a port number")
    return host, int(port_text)


def probe_ray_address(address: str | None, *, flag: str = "--ray-address",
                      timeout: float | None = None) -> None:
    """Nothing when ``address`` is local or accepts a TCP connection within ``timeout`` (default
    :data:`CONNECT_TIMEOUT_S`, read at each call); else InputError naming ``flag`` and it."""
    if address is None or address.strip().lower() in LOCAL_ADDRESSES:
        return
    try:
        host, port = host_port(address.strip())
    except InputError as e:
        raise InputError(str(e), key=flag) from None
    wait = CONNECT_TIMEOUT_S if timeout is None else timeout
    try:
        with socket.create_connection((host, port), timeout=wait):
            pass
    except OSError as e:
        why = "timed out" if isinstance(e, TimeoutError) else (e.strerror or str(e))
        raise InputError(f"cannot reach a Ray cluster at {address} ({host}:{port}): {why} "
                         f"(waited at most {wait:g} s)", key=flag) from None
