"""A cap on the connections the coordinator's control socket holds at once.

ZeroMQ accepts every TCP connection to a bound port and keeps it until its handshake completes or
times out; a flood of idle connections would take every file descriptor the coordinator has (its REST
port could then accept nobody). The socket's monitor reports each connection accepted and closed, with
its descriptor: past the cap, a new connection is shut down at once (the peer sees a reset and ZeroMQ
closes its end), so the replicas already connected keep theirs and descriptors stay free.
"""

from __future__ import annotations

import contextlib
import logging
import socket

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from omni_mesh.security import Refusals

log = logging.getLogger("omni_mesh.coordinator")

#: The default cap, for a coordinator not told (OMNI_MESH_MAX_CONTROL_CONNECTIONS): room for many
#: replicas, far below the descriptors a raised limit gives. It never takes over a quarter of them.
MAX_CONTROL_CONNECTIONS = 1024
_OPENED = zmq.EVENT_ACCEPTED
_CLOSED = zmq.EVENT_DISCONNECTED | zmq.EVENT_CLOSED


def default_cap(fd_limit: int) -> int:
    return max(16, min(MAX_CONTROL_CONNECTIONS, fd_limit // 4))


class ConnectionCap:
    """Watches `router`'s connections; refuses (and counts in `refusals`) those beyond `cap`."""

    def __init__(self, router: zmq.asyncio.Socket, cap: int, refusals: Refusals) -> None:
        self.cap = cap
        self.refusals = refusals
        self.over_cap = 0  # connections refused for the cap (also counted in `refusals`)
        self.open: set[int] = set()  # descriptors of the connections the socket holds now
        self._monitor = router.get_monitor_socket(_OPENED | _CLOSED)

    async def run(self) -> None:
        while True:
            event = parse_monitor_message(await self._monitor.recv_multipart())
            fd = event["value"]
            if event["event"] & _CLOSED:
                self.open.discard(fd)
            elif len(self.open) >= self.cap:
                self._refuse(fd, event["endpoint"])
            else:
                self.open.add(fd)

    def _refuse(self, fd: int, endpoint: bytes) -> None:
        port = int(endpoint.rsplit(b":", 1)[1]) if endpoint.rsplit(b":", 1)[-1].isdigit() else None
        try:
            # Wrapped, not duplicated: at the descriptor limit (what a flood brings about) a dup fails.
            # ZeroMQ owns the descriptor and closes it once it sees the shutdown: we only detach.
            conn = socket.socket(fileno=fd)
        except OSError:
            return  # already closed by ZeroMQ: nothing to refuse
        try:
            # The descriptor may have been closed and reused since the event: shut it down only if it
            # is still a connection accepted on our control port.
            if conn.family not in (socket.AF_INET, socket.AF_INET6) or conn.getsockname()[1] != port:
                return
            conn.getpeername()  # a connection, not the listener
            conn.shutdown(socket.SHUT_RDWR)
        except OSError:
            return
        finally:
            conn.detach()
        self.over_cap += 1
        self.refusals.refuse(f"a connection over the cap of {self.cap} concurrent control connections")

    def close(self, router: zmq.asyncio.Socket) -> None:
        with contextlib.suppress(zmq.ZMQError):
            router.disable_monitor()
        self._monitor.close(0)
