"""A free TCP port on an address, without pyzmq (``protocols.sockets`` re-exports it): the GPU checks pick the
rendezvous ports of their groups with it on a box that has no pyzmq (``scripts/gpu_check.sh``)."""

from __future__ import annotations

import socket


def free_tcp_port(host: str = "127.0.0.1") -> int:
    """A port the kernel reports free on ``host`` now (another process may still take it before it is bound)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return s.getsockname()[1]
