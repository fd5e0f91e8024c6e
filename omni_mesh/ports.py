"""Ports chosen here for another program to bind: the one place that picks them.

A socket we bind ourselves binds port 0 and reads the port back (ZeroMQ: `LAST_ENDPOINT`, as
`connectors/served/channel.py` does): nothing can take it in between. Only a port handed to another
program (the coordinator's control and REST ports the launcher gives its children, `mooncake_master`,
a `dscli` worker, a transfer engine's RPC port) has to be picked first. The kernel may hand the same
port to someone else before that program binds it, so a caller that starts the program checks
`taken_since` after a failed start and retries with fresh ports.
"""

from __future__ import annotations

import socket

#: Bind addresses that mean "every interface": never an address a peer can reach (connectors and the
#: ingress advertise another).
WILDCARDS = ("0.0.0.0", "*", "::")


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on at `host` now (the kernel's pick for port 0)."""
    with socket.socket(_family(host), socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """`count` distinct free ports (all held while picking, so none repeats)."""
    sockets = [socket.socket(_family(host), socket.SOCK_STREAM) for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind((host, 0))
        return [int(sock.getsockname()[1]) for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def taken_since(host: str, ports: list[int]) -> bool:
    """Whether any of `ports` cannot be bound at `host` now: after a program we handed them to failed
    and exited, that means another process took one in between (retry with fresh ports), not that
    the program itself is broken (report its error)."""
    for port in ports:
        with socket.socket(_family(host), socket.SOCK_STREAM) as probe:
            # Connections the program left in TIME_WAIT do not count: only a live socket on the port does.
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind((host, port))
            except OSError:
                return True
    return False
