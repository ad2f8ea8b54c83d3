"""Reaching a Ray cluster's address before anything waits on it.

``ray.init`` with an address nobody answers retries for minutes (``127.0.0.1:1``: no error after
150 s), and the plan step that called it held the job's plan lock and the token cache's writer lock
meanwhile, so every shard's write and the next plan waited too. A TCP connection to the address,
tried first with a timeout and before any lock is taken, fails within a minute naming it."""

from __future__ import annotations

import socket

REACH_TIMEOUT_S = 30.0
_DEFAULT_PORTS = {"ray": 10001}  # Ray Client's; a bare host:port is the GCS


class RayUnreachable(RuntimeError):
    """Nothing answers at the job's ray_address; the message names it and the fix."""


def host_and_port(address: str) -> tuple[str, int] | None:
    """The host and port a Ray address connects to (None: one Ray finds itself, ``auto`` or ``local``)."""
    scheme, _, rest = address.rpartition("://")
    if rest in ("auto", "local", ""):
        return None
    host, _, port = rest.rpartition(":")
    if not host:
        return (rest, _DEFAULT_PORTS[scheme]) if scheme in _DEFAULT_PORTS else None
    return host.strip("[]"), int(port)


def check_reachable(address: str | None, what: str, timeout_s: float = REACH_TIMEOUT_S) -> None:
    """Raise ``RayUnreachable`` unless something accepts a connection at ``address`` within ``timeout_s``
    (None or ``auto``: a local Ray, nothing to reach)."""
    target = host_and_port(address) if address else None
    if target is None:
        return
    try:
        with socket.create_connection(target, timeout=timeout_s):
            return
    except (OSError, ValueError) as exc:
        raise RayUnreachable(f"{what}: nothing answers at ray_address {address!r} ({exc}); start the cluster, "
                             "correct the address, or unset it for a local Ray") from None

