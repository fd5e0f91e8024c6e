"""The ZeroMQ side channel between a producer and its consumers.

`RouterServer` answers requests `[op, key, *args]` on one background thread, sending reply frames
zero-copy; a handler may instead answer later, from another thread (`Deferred`). Replies are
`[OK, key, *frames]` or `[ERR, key, reason]`. Consumers send requests through a
`served.dealers.DealerPool`. Who may connect, and the size of a request, are `served.guard`'s.
"""

from __future__ import annotations

import collections
import contextlib
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import zmq

from omni_mesh.connectors._addresses import tcp_endpoint
from omni_mesh.connectors.errors import ConnectorError
from omni_mesh.connectors.pools.held import PendingReleases
from omni_mesh.connectors.served.guard import ChannelGuard
from omni_mesh.security import MeshKeys

_POLL_MS = 50  # server loop granularity: how late a TTL expiry or a stop request may be noticed
_TICK_S = 0.1

OK = b"OK"
ERR = b"ERR"

Answer = Callable[[list[Any]], None]
Reply = tuple[list[Any], "Callable[[], None] | None"]


class Deferred:
    """A handler's reply that comes later: the server calls `start(answer)`, which hands the work to
    another thread; that thread calls `answer(frames)` once, when done (frames are copied)."""

    __slots__ = ("start",)

    def __init__(self, start: Callable[[Answer], object]) -> None:
        self.start = start


Handler = Callable[[list[bytes]], "Reply | Deferred"]


class RouterServer:
    """A ROUTER socket served by one background thread.

    Requests are [op, *args]; `handlers[op](args)` returns (reply frames, on_sent) or a `Deferred`.
    Reply frames are sent zero-copy; `on_sent` runs once libzmq has let go of them (the memory may
    then be reused). Deferred answers come back through a queue the thread wakes up for (a pipe it
    polls beside the socket). `tick()` runs between polls for housekeeping such as TTL expiry.
    With `keys` the socket runs CURVE and admits only the mesh (`ChannelGuard`, polled here too).
    Malformed requests are answered with ERR where they can be, counted and logged rate-limited.
    """

    def __init__(
        self,
        ctx: zmq.Context,
        bind_host: str,
        port: int,
        handlers: dict[bytes, Handler],
        tick: Callable[[], None],
        owner: str,
        *,
        keys: MeshKeys | None = None,
        port_name: str = "port",
    ) -> None:
        self._ctx = ctx
        self.guard = ChannelGuard(owner, keys)
        self._port_name = port_name  # the config key that sets the port, for errors
        self._bind = tcp_endpoint(bind_host, port or "*")
        self._handlers = handlers
        self._tick = tick
        self._owner = owner
        self._stop = threading.Event()
        self._ready = threading.Event()
        self.port = 0
        self.error: BaseException | None = None
        self._sending = PendingReleases()  # on_sent of replies libzmq still sends from
        self._later: collections.deque[list[Any]] = collections.deque()  # deferred answers to send
        self._wake_read, self._wake_write = socket.socketpair()  # wakes the thread up for them
        self._wake_write.setblocking(False)
        self._wake_lock = threading.Lock()  # no wake-up is written while stop() closes the pair
        self._thread = threading.Thread(target=self._run, name=f"{owner}-server", daemon=True)

    def start(self) -> int:
        self._thread.start()
        self._ready.wait(10)
        if self.error is not None or not self.port:
            raise ConnectorError(
                f"{self._owner}: cannot serve on {self._bind}: {self.error or 'bind timed out'}; "
                f"set `{self._port_name}` to a free port (0 picks any) and `host` to an address of this host"
            )
        return self.port

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(5)
        with self._wake_lock:
            self._wake_write.close()
        if not self._thread.is_alive():
            self._wake_read.close()

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
            guarding = self.guard.arm(self._ctx, sock)
            sock.bind(self._bind)
            self.port = int(sock.getsockopt_string(zmq.LAST_ENDPOINT).rsplit(":", 1)[1])
            self._ready.set()
            self._serve(sock, guarding)
        except BaseException as exc:  # surfaced by start() and by the owner's health()
            self.error = exc
        finally:
            self._ready.set()
            self.guard.close(sock)
            sock.close(linger=0)

    def reap(self) -> None:
        """Run `on_sent` for every reply libzmq has let go of (any thread may call this)."""
        self._sending.reap()

    def _serve(self, sock: zmq.Socket, guarding: list[zmq.Socket]) -> None:
        poller = zmq.Poller()
        for polled in (sock, *guarding):
            poller.register(polled, zmq.POLLIN)
        wake = self._wake_read.fileno()
        poller.register(wake, zmq.POLLIN)
        next_tick = time.monotonic()
        while not self._stop.is_set():
            ready = dict(poller.poll(_POLL_MS))
            if sock in ready:
                for _ in range(256):  # drain what is queued, then do housekeeping
                    try:
                        request = sock.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self._answer(sock, request)
            if wake in ready:
                self._wake_read.recv(4096)
                self._send_later(sock)
            if len(ready) > (sock in ready) + (wake in ready):
                self.guard.handle(ready)
            self.reap()
            now = time.monotonic()
            if now >= next_tick:
                next_tick = now + _TICK_S
                with contextlib.suppress(Exception):  # housekeeping must never stop the server
                    self._tick()

    def _answer(self, sock: zmq.Socket, request: list[bytes]) -> None:
        if len(request) < 2:
            self.guard.malformed.refuse("a request without an operation")
            return  # not a request of ours: there is nothing sensible to answer
        identity, op, args = request[0], request[1], request[2:]
        on_sent = None
        handler = self._handlers.get(op)
        try:
            if handler is None:
                raise ValueError(f"unknown request {op[:32]!r}")
            reply = handler(args)
            if isinstance(reply, Deferred):
                reply.start(self._answer_later(identity))
                return
            frames, on_sent = reply
        except Exception as exc:  # a bad request must never stop the server
            reason = f"{type(exc).__name__}: {exc}"[:200]
            self.guard.malformed.refuse(f"a malformed request ({reason})")
            frames = [ERR, args[0][:256] if args else b"", reason.encode()]
        try:
            tracker = sock.send_multipart([identity, *frames], copy=False, track=on_sent is not None)
        except zmq.ZMQError:
            tracker = None  # the peer is gone: the message is dropped, its memory released
        if on_sent is not None:
            if tracker is None or tracker.done:
                on_sent()
            else:
                self._sending.add(lambda: tracker.done, on_sent)

    def _answer_later(self, identity: bytes) -> Answer:
        def answer(frames: list[Any]) -> None:
            self._later.append([identity, *frames])
            with self._wake_lock, contextlib.suppress(OSError):  # full: a wake-up is pending; closed: stopped
                self._wake_write.send(b"\0")

        return answer

    def _send_later(self, sock: zmq.Socket) -> None:
        while self._later:
            with contextlib.suppress(zmq.ZMQError):  # the consumer went away: nothing to tell
                sock.send_multipart(self._later.popleft(), zmq.NOBLOCK)


def frame_text(frame: Any) -> str:
    """A received frame (or bytes) as text, for keys, tokens and error reasons."""
    data = frame.bytes if isinstance(frame, zmq.Frame) else frame
    return bytes(data).decode("utf-8", "replace")
