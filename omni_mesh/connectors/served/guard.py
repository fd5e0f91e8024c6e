"""Who may use a connector's side channel, and what it refused.

With the mesh's keys (omni_mesh.security) every server socket of a side channel runs ZeroMQ CURVE and
its context's ZAP handler admits only clients holding the mesh's key pair: a stranger can neither
read a payload nor ask for a write; it never gets past the handshake. Without keys the channel works
unauthenticated and says so once per process. Either way requests are small: a message larger than
the server's limit makes libzmq drop the peer before buffering it. Refused peers (failed handshakes,
ZAP refusals) and malformed requests are counted for health() and logged at most once per interval,
so a flood cannot fill the log.
"""

from __future__ import annotations

import logging
import threading

import zmq
from zmq.utils.monitor import parse_monitor_message

from omni_mesh.connectors.errors import ConnectorError
from omni_mesh.security import (
    ENV_KEYS_DIR,
    MeshKeyError,
    MeshKeys,
    Refusals,
    bind_zap,
    insecure_requested,
    mesh_keys,
    secure_server,
    zap_reply,
)

log = logging.getLogger("omni_mesh.connectors")

MAX_REQUEST_BYTES = 64 * 1024  # side-channel requests are a few hundred bytes (device lists: a few KiB)
# Handshakes that failed before ZAP was asked: no or another security mechanism, the wrong server
# key, or not ZeroMQ at all. ZAP refusals (EVENT_HANDSHAKE_FAILED_AUTH) are counted by zap_reply.
_FAILED_HANDSHAKES = zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL

_warned = False
_warned_lock = threading.Lock()


def side_channel_keys(owner: str) -> MeshKeys | None:
    """The mesh keys a connector's side channel uses (read once, at construction); None: CURVE off."""
    global _warned
    try:
        keys = mesh_keys()
    except MeshKeyError as exc:
        raise ConnectorError(f"{owner}: {exc}") from None
    if keys is None and not insecure_requested():
        with _warned_lock:
            warn, _warned = not _warned, True
        if warn:
            log.warning(
                "connector side channels run WITHOUT authentication or encryption: anyone who reaches "
                "their ports can fetch payloads or ask for writes. Create mesh keys with `omni-mesh keys "
                "generate DIR` and set %s=DIR for every process of the mesh (or OMNI_MESH_INSECURE=1 to "
                "accept this and silence the warning)",
                ENV_KEYS_DIR,
            )
    return keys


class ChannelGuard:
    """The security of one side-channel server socket, and its counts of what it refused."""

    def __init__(self, owner: str, keys: MeshKeys | None) -> None:
        self.keys = keys
        self.refused = Refusals(f"{owner} side channel")
        self.malformed = Refusals(f"{owner} side channel")
        self._zap: zmq.Socket | None = None
        self._monitor: zmq.Socket | None = None

    def arm(self, ctx: zmq.Context, sock: zmq.Socket) -> list[zmq.Socket]:
        """Before `sock` binds: its size limit, CURVE and its context's ZAP handler (with keys; one
        per context), a monitor of failed handshakes. Returns the sockets to poll beside it."""
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_REQUEST_BYTES)
        secure_server(sock, self.keys)
        self._zap = bind_zap(ctx, self.keys)  # before the bind: without a handler libzmq admits anyone
        self._monitor = sock.get_monitor_socket(_FAILED_HANDSHAKES)
        return [s for s in (self._zap, self._monitor) if s is not None]

    def handle(self, ready: dict) -> None:
        """Answer ZAP requests and count failed handshakes among the `ready` sockets of a poll."""
        if self._zap is not None and self._zap in ready:
            while self._zap.poll(0):
                self._zap.send_multipart(zap_reply(self._zap.recv_multipart(), self.keys, self.refused))
        if self._monitor is not None and self._monitor in ready:
            while self._monitor.poll(0):
                parse_monitor_message(self._monitor.recv_multipart())
                self.refused.refuse(
                    "a peer whose handshake failed (no mesh keys, another server key, or not ZeroMQ)"
                )

    def close(self, sock: zmq.Socket) -> None:
        """On the thread that armed `sock`, before closing it."""
        if self._monitor is not None:
            sock.disable_monitor()
            self._monitor.close(linger=0)
        if self._zap is not None:
            self._zap.close(linger=0)
