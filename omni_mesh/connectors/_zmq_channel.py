"""The ZeroMQ side channel between a producer and its consumers.

`RouterServer` answers requests `[op, key, *args]` on one background thread, sending reply frames
zero-copy; `DealerPool` sends requests from any consumer thread and never reuses a socket whose
request failed. Replies are `[OK, key, *frames]` or `[ERR, key, reason]`.
"""

from __future__ import annotations

import contextlib
import errno
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import zmq

from omni_mesh.connectors._addresses import tcp_endpoint
from omni_mesh.connectors.base import ConnectorError

_POLL_MS = 50  # server loop granularity: how late a TTL expiry or a stop request may be noticed
_TICK_S = 0.1

OK = b"OK"
ERR = b"ERR"

Reply = tuple[list[Any], "Callable[[], None] | None"]
Handler = Callable[[list[bytes]], Reply]


class RouterServer:
    """A ROUTER socket served by one background thread.

    Requests are [op, *args]; `handlers[op](args)` returns (reply frames, on_sent). Reply frames are
    sent zero-copy; `on_sent` runs once libzmq has let go of them (the memory may then be reused).
    `tick()` runs between polls for housekeeping such as TTL expiry.
    """

    def __init__(
        self,
        ctx: zmq.Context,
        bind_host: str,
        port: int,
        handlers: dict[bytes, Handler],
        tick: Callable[[], None],
        owner: str,
    ) -> None:
        self._ctx = ctx
        self._bind = tcp_endpoint(bind_host, port or "*")
        self._handlers = handlers
        self._tick = tick
        self._owner = owner
        self._stop = threading.Event()
        self._ready = threading.Event()
        self.port = 0
        self.error: BaseException | None = None
        self._pending: list[tuple[zmq.MessageTracker, Callable[[], None]]] = []
        self._pending_lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name=f"{owner}-server", daemon=True)

    def start(self) -> int:
        self._thread.start()
        self._ready.wait(10)
        if self.error is not None or not self.port:
            raise ConnectorError(
                f"{self._owner}: cannot serve on {self._bind}: {self.error or 'bind timed out'}; "
                "set `port` to a free port (0 picks any) and `host` to an address of this host"
            )
        return self.port

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(5)

    def _run(self) -> None:
        try:
            sock = self._ctx.socket(zmq.ROUTER)
        except zmq.ZMQError as exc:
            self.error = exc
            self._ready.set()
            return
        try:
            sock.setsockopt(zmq.LINGER, 0)
            if self._bind.startswith("tcp://["):
                sock.setsockopt(zmq.IPV6, 1)
            sock.bind(self._bind)
            self.port = int(sock.getsockopt_string(zmq.LAST_ENDPOINT).rsplit(":", 1)[1])
            self._ready.set()
            self._serve(sock)
        except BaseException as exc:  # surfaced by start() and by the owner's health()
            self.error = exc
        finally:
            self._ready.set()
            sock.close(linger=0)

    def reap(self) -> None:
        """Run `on_sent` for every reply libzmq has let go of (any thread may call this)."""
        with self._pending_lock:
            if not self._pending:
                return
            done, keep = [], []
            for item in self._pending:
                (done if item[0].done else keep).append(item)
            self._pending = keep
        for _, on_sent in done:
            on_sent()

    def _serve(self, sock: zmq.Socket) -> None:
        next_tick = time.monotonic()
        while not self._stop.is_set():
            if sock.poll(_POLL_MS, zmq.POLLIN):
                for _ in range(256):  # drain what is queued, then do housekeeping
                    try:
                        request = sock.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self._answer(sock, request)
            self.reap()
            now = time.monotonic()
            if now >= next_tick:
                next_tick = now + _TICK_S
                with contextlib.suppress(Exception):  # housekeeping must never stop the server
                    self._tick()

    def _answer(self, sock: zmq.Socket, request: list[bytes]) -> None:
        if len(request) < 2:
            return  # not a request of ours: there is nothing sensible to answer
        identity, op, args = request[0], request[1], request[2:]
        on_sent = None
        handler = self._handlers.get(op)
        try:
            if handler is None:
                raise ValueError(f"unknown request {op[:32]!r}")
            frames, on_sent = handler(args)
        except Exception as exc:  # a bad request must never stop the server
            frames = [ERR, args[0] if args else b"", f"{type(exc).__name__}: {exc}".encode()]
        try:
            tracker = sock.send_multipart([identity, *frames], copy=False, track=on_sent is not None)
        except zmq.ZMQError:
            tracker = None  # the peer is gone: the message is dropped, its memory released
        if on_sent is not None:
            if tracker is None or tracker.done:
                on_sent()
            else:
                with self._pending_lock:
                    self._pending.append((tracker, on_sent))


class ChannelClosed(Exception):
    """The connector was closed while a request was in flight."""


class DealerPool:
    """Request/reply to ROUTER endpoints from many threads.

    Idle DEALER sockets are cached per endpoint (usually one); a thread checks one out for a whole
    request, so concurrent requests never share a socket. A socket whose request failed or timed out
    is closed (LINGER 0), never reused: a late reply cannot be read as the answer to the next request.
    Only the most recently used endpoints keep idle sockets, so producers that come and go (restarted
    replicas, new ports) do not leave sockets reconnecting forever.
    """

    MAX_ENDPOINTS = 64
    MAX_IDLE_PER_ENDPOINT = 8

    def __init__(self, ctx: zmq.Context) -> None:
        self._ctx = ctx
        self._idle: OrderedDict[str, list[zmq.Socket]] = OrderedDict()
        self._lock = threading.Lock()
        self._closed = False

    def request(self, endpoint: str, parts: list[bytes], timeout_s: float) -> list[zmq.Frame]:
        """Send `parts` and return the reply frames (zero-copy); TimeoutError past `timeout_s`."""
        sock = self._checkout(endpoint)
        try:
            sock.send_multipart(parts, zmq.NOBLOCK)
            if not sock.poll(max(0, int(timeout_s * 1000)), zmq.POLLIN):
                raise TimeoutError(f"no reply within {timeout_s:g}s")
            reply = sock.recv_multipart(copy=False)
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
            sock.setsockopt(zmq.LINGER, 0)
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
                if len(idle) < self.MAX_IDLE_PER_ENDPOINT:
                    idle.append(sock)
                    evicted = []
                while len(self._idle) > self.MAX_ENDPOINTS:
                    evicted += self._idle.popitem(last=False)[1]
        for old in evicted:
            old.close(linger=0)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            sockets = [s for idle in self._idle.values() for s in idle]
            self._idle.clear()
        for sock in sockets:
            sock.close(linger=0)


def frame_text(frame: Any) -> str:
    """A received frame (or bytes) as text, for keys, tokens and error reasons."""
    data = frame.bytes if isinstance(frame, zmq.Frame) else frame
    return bytes(data).decode("utf-8", "replace")
