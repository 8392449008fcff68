"""Start a local Ray cluster whose every process listens on loopback (127.0.0.1) only.

A plain ``ray.init()`` binds the GCS, the raylet, the agents and each worker's gRPC server to
every interface (``0.0.0.0`` / ``::``) or to the machine's external address, so anyone on the
network could reach the cluster rlaudit started. Ray binds loopback only when the node's IP is
a loopback address, but ``ray.init(_node_ip_address="127.0.0.1")`` alone does not give it one:
Ray swaps a loopback address for the machine's reachable IP
(``ray._private.services.resolve_ip_for_localhost``) unless multi-node clusters are disabled
(``ray_constants.ENABLE_RAY_CLUSTER``, read from ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER`` when Ray is
imported). :func:`init_local_cluster` turns that switch off for the start only, then checks the
node Ray reports and refuses to go on with one that is not on loopback.

A cluster named by ``--ray-address`` / ``RAY_ADDRESS`` is the user's: rlaudit only connects.
"""

from __future__ import annotations

import contextlib
import ipaddress
from typing import Iterator

LOOPBACK = "127.0.0.1"


@contextlib.contextmanager
def _single_node_addresses() -> Iterator[None]:
    """While open, Ray keeps a loopback node address instead of swapping in the external IP."""
    from ray._private import ray_constants  # lazy: Ray is an optional, slow import

    before = ray_constants.ENABLE_RAY_CLUSTER
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = before


def is_loopback(host: str) -> bool:
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return host == "localhost"
    return (getattr(ip, "ipv4_mapped", None) or ip).is_loopback


def init_local_cluster(**init_kwargs) -> str:
    """``ray.init(**init_kwargs)`` for a new local cluster bound to loopback; returns its node IP.

    Raises RuntimeError (after shutting the cluster down) if Ray put the node anywhere else.
    """
    import ray  # lazy: Ray is an optional, slow import

    with _single_node_addresses():
        ray.init(_node_ip_address=LOOPBACK, dashboard_host=LOOPBACK, **init_kwargs)
    node_ip = ray.util.get_node_ip_address()
    if not is_loopback(node_ip):
        ray.shutdown()
        raise RuntimeError(f"the local Ray cluster started on {node_ip}, not on loopback "
                           f"({LOOPBACK}): it would be reachable from the network, so rlaudit "
                           "stopped it; pass --ray-address to use a cluster you started")
    return node_ip
