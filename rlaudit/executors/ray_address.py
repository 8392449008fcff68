"""A Ray cluster address checked before ``ray.init`` joins it.

``ray.init(address="host:port")`` with nothing listening there retries its GCS connection for
minutes, and ~22 s against a port that listens but is not Ray's; ``rlaudit run --executor ray
--ray-address ADDR`` instead tries one TCP connection and gRPC's HTTP/2 handshake (Ray's GCS and
client server are gRPC; skipped with ``RAY_USE_TLS``), each within :data:`CONNECT_TIMEOUT_S`,
and stops with the address named and what went wrong.

    probe_ray_address("ray://head:10001", flag="--ray-address")
"""

from __future__ import annotations

import os
import socket
import time

from rlaudit.errors import InputError

#: seconds one TCP connection to the cluster may take before the address counts as unreachable
CONNECT_TIMEOUT_S = 5.0
#: Ray's default ports: the GCS of ``host:port`` addresses, the client server of ``ray://``
GCS_PORT, CLIENT_PORT = 6379, 10001
#: addresses Ray resolves itself (a file on this node, or a new local cluster): nothing to probe
LOCAL_ADDRESSES = ("auto", "local", "")
#: an HTTP/2 client's connection preface with an empty SETTINGS frame (RFC 9113 section 3.4),
#: the length of a frame header, and the SETTINGS frame type a server answers with
H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])
H2_FRAME_HEADER, H2_SETTINGS = 9, 4


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
        with socket.create_connection((host, port), timeout=wait) as conn:
            if os.environ.get("RAY_USE_TLS", "0").lower() in ("0", "false", ""):
                why = grpc_handshake_problem(conn, wait)
                if why:
                    raise InputError(f"{address} ({host}:{port}) is not a Ray cluster: {why}",
                                     key=flag)
    except OSError as e:
        why = "timed out" if isinstance(e, TimeoutError) else (e.strerror or str(e))
        raise InputError(f"cannot reach a Ray cluster at {address} ({host}:{port}): {why} "
                         f"(waited at most {wait:g} s)", key=flag) from None


def grpc_handshake_problem(conn: socket.socket, wait: float) -> str | None:
    """None when the server on ``conn`` opens an HTTP/2 connection as gRPC servers do (Ray's GCS
    and its client server are gRPC): to the client's preface it answers with a SETTINGS frame
    (RFC 9113 section 3.4). Else what it did instead, within ``wait`` seconds all told -- where
    ``ray.init`` would retry for ~22 s and then report a failed GCS connection."""
    deadline = time.monotonic() + wait
    got = b""
    try:
        conn.sendall(H2_PREFACE)
        while len(got) < H2_FRAME_HEADER:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError
            conn.settimeout(left)
            chunk = conn.recv(H2_FRAME_HEADER - len(got))
            if not chunk:
                return "it closed the connection without answering gRPC's HTTP/2 handshake"
            got += chunk
    except (TimeoutError, socket.timeout):
        return (f"it accepts connections but did not answer gRPC's HTTP/2 handshake within "
                f"{wait:g} s")
    except OSError as e:
        return f"the connection failed during gRPC's HTTP/2 handshake ({e.strerror or e})"
    if got[3] != H2_SETTINGS:
        return (f"it answered {got[:H2_FRAME_HEADER]!r}, not gRPC's HTTP/2 handshake (is it "
                "another service's port?)")
    return None
