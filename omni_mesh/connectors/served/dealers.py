"""`DealerPool`: a consumer's requests to producers' side channels (`served.channel.RouterServer`).

Idle DEALER sockets are cached per endpoint (usually one); a thread checks one out for a whole
request, so concurrent requests never share a socket. A socket whose request failed or timed out is
closed (LINGER 0), never reused: a late reply cannot be read as the answer to the next request. Only
the most recently used endpoints keep idle sockets, and (with `idle_s`) `reap_idle()` closes those
unused for that long, so producers that come and go (restarted replicas, new ports) do not leave
sockets reconnecting forever.

Dead peers are noticed in about a second, not at the request's deadline: a monitor reports each
socket's connection events (a dead process's kernel closes its connections at once), and every socket
sends ZeroMQ heartbeats (a peer silent for HEARTBEAT_TIMEOUT_MS is disconnected: a cut network or a
frozen host, which close nothing). A request whose connection breaks after it was sent
can never be answered (the producer's ROUTER drops replies to a lost peer), so it fails at once with
PeerLost; one whose peer refuses connections (its process is gone) fails after PEER_REFUSED_S.
"""

from __future__ import annotations

import contextlib
import errno
import threading
import time
from collections import OrderedDict

import zmq
from zmq.utils.monitor import recv_monitor_message

from omni_mesh.security import MeshKeys, secure_client


class ChannelClosed(Exception):
    """The connector was closed while a request was in flight."""


class NotConnected(TimeoutError):
    """No connection to the endpoint within the connect timeout; nothing was sent."""


HEARTBEAT_IVL_MS = 1000  # a PING this often on every connection...
# ...and a peer silent this long is disconnected (a cut network, a frozen host). Not shorter: with 2 s a
# 256 MiB reply on this project's loaded 2-vCPU VM lost its connection mid-transfer (2026-12-01). A
# process that dies is noticed at once anyway: its kernel closes the connection.
HEARTBEAT_TIMEOUT_MS = 10_000
PEER_REFUSED_S = 1.5  # a request whose peer refuses connections this long fails (its process is gone)
_EVENTS = zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECT_RETRIED


class _Link:
    """A DEALER socket and its monitor: whether the connection to the peer stands."""

    __slots__ = ("sock", "monitor", "poller", "up", "broke", "refused_since")

    def __init__(self, sock: zmq.Socket) -> None:
        self.sock = sock
        self.monitor = sock.get_monitor_socket(_EVENTS)
        self.poller = zmq.Poller()  # made once: requests are latency-bound
        self.poller.register(sock, zmq.POLLIN)
        self.poller.register(self.monitor, zmq.POLLIN)
        self.up = False
        self.broke = False  # the connection went down since `arm()`
        self.refused_since: float | None = None  # connect attempts failing since then, while not up

    def arm(self) -> None:
        """Read the events so far; from here on a broken connection counts against the request."""
        self.watch()
        self.broke = False
        self.refused_since = None

    def watch(self) -> None:
        while self.monitor.poll(0):
            event = recv_monitor_message(self.monitor)["event"]
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self.up, self.refused_since = True, None
            elif event == zmq.EVENT_DISCONNECTED:
                self.up, self.broke = False, True
            elif event == zmq.EVENT_CONNECT_RETRIED and not self.up and self.refused_since is None:
                self.refused_since = time.monotonic()

    def lost(self) -> str | None:
        """Why the request in flight will not be answered, or None while it may be."""
        if self.broke:
            return "the connection to the producer broke (a network fault, or its process died or stopped answering heartbeats)"
        if self.refused_since is not None and time.monotonic() - self.refused_since >= PEER_REFUSED_S:
            return f"the producer refuses connections (for {PEER_REFUSED_S:g}s): its process is gone"
        return None

    def close(self) -> None:
        # The monitor stops before either socket closes: closed as they were, a socket made right after
        # (a get asked again) now and then reported no event at all, and waited out its deadline for a
        # dead producer (1 in 2-16 tries on this VM; 0 in 30 with this order).
        with contextlib.suppress(zmq.ZMQError):
            self.sock.disable_monitor()
        self.monitor.close(linger=0)
        self.sock.close(linger=0)


class LateReply(TimeoutError):
    """A request was sent but not answered in time. The caller owns the socket its answer may still
    arrive on: `arrived()` says whether it has, `close()` discards the socket."""

    def __init__(self, message: str, link: _Link) -> None:
        super().__init__(message)
        self.link = link

    def arrived(self) -> bool:
        # The socket carried one request: any message is its answer.
        return bool(self.link.sock.poll(0, zmq.POLLIN))

    def close(self) -> None:
        self.link.close()


class PeerLost(LateReply):
    """The producer went away while the request waited (see the module docstring): no answer will come.
    With `keep_late` the caller still owns the socket (a producer cut off by the network may yet write).
    `broke`: the connection broke (the producer may still be there: asking again may be answered),
    rather than the producer refusing connections (its process is gone)."""

    def __init__(self, message: str, link: _Link) -> None:
        super().__init__(message, link)
        self.broke = link.broke


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
        self._options = {
            zmq.LINGER: 0,
            zmq.IMMEDIATE: int(immediate),
            zmq.MAXMSGSIZE: max_reply_bytes,
            zmq.HEARTBEAT_IVL: HEARTBEAT_IVL_MS,
            zmq.HEARTBEAT_TIMEOUT: HEARTBEAT_TIMEOUT_MS,
            zmq.HEARTBEAT_TTL: HEARTBEAT_TIMEOUT_MS,
        }
        self._idle_s = idle_s
        self._idle: OrderedDict[str, list[_Link]] = OrderedDict()
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
        accepts a connection; PeerLost as soon as the producer is known to be gone; with `keep_late`,
        LateReply or PeerLost (holding the socket) when the reply is late or will not come.
        """
        link = self._checkout(endpoint)
        sock = link.sock
        try:
            if connect_timeout_s is not None and not sock.poll(int(connect_timeout_s * 1000), zmq.POLLOUT):
                raise NotConnected(f"no connection within {connect_timeout_s:g}s")
            link.arm()
            sock.send_multipart(parts, zmq.NOBLOCK)
            self._wait_reply(link, timeout_s)
            reply = sock.recv_multipart(copy=False)
        except BaseException as exc:
            raise _failed(link, exc, keep_late) from None
        self._checkin(endpoint, link)
        return reply

    def resume(self, endpoint: str, late: LateReply, timeout_s: float) -> list[zmq.Frame]:
        """Wait again, up to `timeout_s`, for the answer to a request that was late (`keep_late`):
        its reply frames; LateReply or PeerLost (the caller still owns the socket) as in `request`."""
        link = late.link
        try:
            self._wait_reply(link, timeout_s)
            reply = link.sock.recv_multipart(copy=False)
        except BaseException as exc:
            raise _failed(link, exc, keep_late=True) from None
        self._checkin(endpoint, link)
        return reply

    @staticmethod
    def _wait_reply(link: _Link, timeout_s: float) -> None:
        """Return once the reply is there; LateReply past `timeout_s`, PeerLost when it cannot come."""
        poller = link.poller
        started = time.monotonic()
        deadline = started + timeout_s
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise LateReply(f"no reply within {timeout_s:g}s", link)
            # Wake up now and then even without events, to tell refused connections from slow ones.
            ready = dict(poller.poll(max(1, int(min(remaining, PEER_REFUSED_S / 3) * 1000))))
            if link.sock in ready:
                return
            link.watch()
            reason = link.lost()
            if reason is not None:
                raise PeerLost(f"{reason}; noticed {time.monotonic() - started:.1f}s after the request", link)

    def _checkout(self, endpoint: str) -> _Link:
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
            link = _Link(sock)  # monitored before it connects: no connection event is missed
        except BaseException:
            sock.close(linger=0)
            raise
        try:
            sock.connect(endpoint)  # raises for a malformed endpoint
        except BaseException:
            link.close()
            raise
        return link

    def _checkin(self, endpoint: str, sock: _Link) -> None:
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
            old.close()

    def _pop_locked(self, endpoint: str) -> list[_Link]:
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
            sock.close()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            sockets = [s for idle in self._idle.values() for s in idle]
            self._idle.clear()
            self._used.clear()
        for sock in sockets:
            sock.close()


def _failed(link: _Link, exc: BaseException, keep_late: bool) -> BaseException:
    """What a failed request (or resumed wait) raises: its socket closed (a late answer must never be
    taken for the next one's) unless a late reply is kept; a late reply as TimeoutError unless kept
    (PeerLost stays itself); a closed context as ChannelClosed; a full send queue as TimeoutError."""
    if isinstance(exc, LateReply) and keep_late:
        return exc
    link.close()
    if isinstance(exc, LateReply):
        return exc if isinstance(exc, PeerLost) else TimeoutError(str(exc))
    if isinstance(exc, zmq.ZMQError) and exc.errno in (errno.ENOTSOCK, zmq.ETERM):
        return ChannelClosed()
    if isinstance(exc, zmq.Again):
        return TimeoutError("the send queue is full")
    return exc
