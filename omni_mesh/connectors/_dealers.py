"""`DealerPool`: a consumer's requests to producers' side channels (`_zmq_channel.RouterServer`).

Idle DEALER sockets are cached per endpoint (usually one); a thread checks one out for a whole
request, so concurrent requests never share a socket. A socket whose request failed or timed out is
closed (LINGER 0), never reused: a late reply cannot be read as the answer to the next request. Only
the most recently used endpoints keep idle sockets, and (with `idle_s`) `reap_idle()` closes those
unused for that long, so producers that come and go (restarted replicas, new ports) do not leave
sockets reconnecting forever.
"""

from __future__ import annotations

import errno
import threading
import time
from collections import OrderedDict

import zmq

from omni_mesh.security import MeshKeys, secure_client


class ChannelClosed(Exception):
    """The connector was closed while a request was in flight."""


class NotConnected(TimeoutError):
    """No connection to the endpoint within the connect timeout; nothing was sent."""


class LateReply(TimeoutError):
    """A request was sent but not answered in time. The caller owns the socket its answer may still
    arrive on: `arrived()` says whether it has, `close()` discards the socket."""

    def __init__(self, message: str, sock: zmq.Socket) -> None:
        super().__init__(message)
        self._sock = sock

    def arrived(self) -> bool:
        return bool(
            self._sock.poll(0, zmq.POLLIN)
        )  # the socket carried one request: any message is its answer

    def close(self) -> None:
        self._sock.close(linger=0)


class DealerPool:
    """Request/reply to ROUTER endpoints from many threads (module docstring).

    `keys`: every socket is a CURVE client with the mesh keys (producers admit nobody else);
    `immediate`: queue nothing for an endpoint not connected yet (needed for `connect_timeout_s`);
    `max_reply_bytes`: a peer sending a larger message is disconnected (-1: no limit).
    """

    MAX_ENDPOINTS = 64
    MAX_IDLE_PER_ENDPOINT = 8

    def __init__(
        self,
        ctx: zmq.Context,
        keys: MeshKeys | None = None,
        *,
        immediate: bool = False,
        max_reply_bytes: int = -1,
        idle_s: float | None = None,
    ) -> None:
        self._ctx = ctx
        self._keys = keys
        self._options = {zmq.LINGER: 0, zmq.IMMEDIATE: int(immediate), zmq.MAXMSGSIZE: max_reply_bytes}
        self._idle_s = idle_s
        self._idle: OrderedDict[str, list[zmq.Socket]] = OrderedDict()
        self._used: dict[str, float] = {}
        self._lock = threading.Lock()
        self._closed = False

    def request(
        self,
        endpoint: str,
        parts: list[bytes],
        timeout_s: float,
        *,
        connect_timeout_s: float | None = None,
        keep_late: bool = False,
    ) -> list[zmq.Frame]:
        """Send `parts` and return the reply frames (zero-copy).

        TimeoutError past `timeout_s`; NotConnected when `connect_timeout_s` passes before the endpoint
        accepts a connection; with `keep_late`, LateReply (holding the socket) when the reply is late.
        """
        sock = self._checkout(endpoint)
        try:
            if connect_timeout_s is not None and not sock.poll(int(connect_timeout_s * 1000), zmq.POLLOUT):
                raise NotConnected(f"no connection within {connect_timeout_s:g}s")
            sock.send_multipart(parts, zmq.NOBLOCK)
            if not sock.poll(max(0, int(timeout_s * 1000)), zmq.POLLIN):
                if keep_late:
                    raise LateReply(f"no reply within {timeout_s:g}s", sock)
                raise TimeoutError(f"no reply within {timeout_s:g}s")
            reply = sock.recv_multipart(copy=False)
        except LateReply:
            raise
        except BaseException as exc:
            sock.close(linger=0)
            if isinstance(exc, zmq.ZMQError) and exc.errno in (errno.ENOTSOCK, zmq.ETERM):
                raise ChannelClosed() from None
            if isinstance(exc, zmq.Again):
                raise TimeoutError("the send queue is full") from None
            raise
        self._checkin(endpoint, sock)
        return reply

    def _checkout(self, endpoint: str) -> zmq.Socket:
        with self._lock:
            if self._closed:
                raise ChannelClosed()
            idle = self._idle.get(endpoint)
            if idle:
                return idle.pop()
            try:
                sock = self._ctx.socket(zmq.DEALER)
            except zmq.ZMQError:
                raise ChannelClosed() from None
        try:
            for option, value in self._options.items():
                sock.setsockopt(option, value)
            secure_client(sock, self._keys)
            if endpoint.startswith("tcp://["):
                sock.setsockopt(zmq.IPV6, 1)
            sock.connect(endpoint)  # raises for a malformed endpoint
        except BaseException:
            sock.close(linger=0)
            raise
        return sock

    def _checkin(self, endpoint: str, sock: zmq.Socket) -> None:
        evicted = [sock]
        with self._lock:
            if not self._closed:
                idle = self._idle.setdefault(endpoint, [])
                self._idle.move_to_end(endpoint)
                self._used[endpoint] = time.monotonic()
                if len(idle) < self.MAX_IDLE_PER_ENDPOINT:
                    idle.append(sock)
                    evicted = []
                while len(self._idle) > self.MAX_ENDPOINTS:
                    evicted += self._pop_locked(next(iter(self._idle)))
        for old in evicted:
            old.close(linger=0)

    def _pop_locked(self, endpoint: str) -> list[zmq.Socket]:
        self._used.pop(endpoint, None)
        return self._idle.pop(endpoint, [])

    def reap_idle(self) -> None:
        """Close the idle sockets of endpoints unused for `idle_s` (their producer may be gone)."""
        if self._idle_s is None:
            return
        stale_before = time.monotonic() - self._idle_s
        with self._lock:
            stale = [endpoint for endpoint, used in self._used.items() if used < stale_before]
            sockets = [sock for endpoint in stale for sock in self._pop_locked(endpoint)]
        for sock in sockets:  # idle: no other thread holds them
            sock.close(linger=0)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            sockets = [s for idle in self._idle.values() for s in idle]
            self._idle.clear()
            self._used.clear()
        for sock in sockets:
            sock.close(linger=0)
