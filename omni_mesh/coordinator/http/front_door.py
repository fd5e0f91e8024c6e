"""The REST port's connections: deadlines, head limits and the connection cap, around uvicorn's parser.

`FrontDoor` is the protocol factory given to `uvicorn.Config(http=...)`. Each connection it makes is a
`Guarded` asyncio protocol that owns the transport and wraps uvicorn's stock httptools protocol: it sees
every byte first (framing.py tells where a request's head and body end), passes them on, and keeps the
limits (limits.py says which). It talks to uvicorn's protocol only through asyncio's Protocol
interface (connection_made, data_received, pause_writing, ...): no subclass, no private attribute, so
a change inside uvicorn cannot silently undo a limit (a changed constructor fails at the first
connection). What only the app knows, that a request was answered, comes back through the ASGI scope's
`state` (uvicorn copies its app state into every request's scope): `Answered`, the outermost
middleware, tells the connection, which makes an idle kept-alive connection one the cap may close.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import struct
from collections.abc import Awaitable, Callable
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol  # what `--http httptools` runs

from omni_mesh.coordinator.http.envelope import error_bytes
from omni_mesh.coordinator.http.framing import Framing, HeadTooLarge

log = logging.getLogger("omni_mesh.coordinator")

#: The key of a request's connection in its ASGI scope's `state` (see Answered).
CONNECTION = "omni_mesh.connection"


class FrontDoor:
    """The limits, and the connections held now (for the cap)."""

    def __init__(self, *, header_timeout_s: float, body_timeout_s: float, write_timeout_s: float,
                 max_head_bytes: int, max_url_bytes: int, max_connections: int | None) -> None:
        self.header_timeout_s = header_timeout_s
        self.body_timeout_s = body_timeout_s
        self.write_timeout_s = write_timeout_s
        self.max_head_bytes = max_head_bytes
        self.max_url_bytes = max_url_bytes
        #: Past it a new connection is answered 503 and closed at once, so idle connections cannot
        #: take every descriptor (the control plane shares them). None: no cap.
        self.max_connections = max_connections
        self.connections: set[Guarded] = set()

    def __call__(self, **uvicorn_arguments: Any) -> Guarded:
        """What uvicorn's server calls for each new connection (config, server_state, app_state, _loop)."""
        return Guarded(self, uvicorn_arguments)

    def make_room(self, newcomer: Guarded) -> bool:
        """Close the kept-alive connection idle longest to make room at the cap (its client reconnects
        when it has a request, as after the keep-alive timeout); False if every connection is busy."""
        idle = [c for c in self.connections if c is not newcomer and c.idle_since is not None]
        if not idle:
            return False
        oldest = min(idle, key=lambda c: c.idle_since or 0.0)
        oldest.transport.close()
        return True


class Guarded(asyncio.Protocol):
    """One connection: uvicorn's protocol behind the front door's limits."""

    def __init__(self, door: FrontDoor, uvicorn_arguments: dict[str, Any]) -> None:
        self.door = door
        self.loop: asyncio.AbstractEventLoop = uvicorn_arguments.get("_loop") or asyncio.get_event_loop()
        app_state = {**uvicorn_arguments["app_state"], CONNECTION: self}  # every request's scope["state"]
        self.inner = HttpToolsProtocol(**{**uvicorn_arguments, "app_state": app_state})
        self.framing = Framing(door.max_head_bytes, door.max_url_bytes)
        self.transport: asyncio.Transport = None  # type: ignore[assignment]
        self.peer: Any = None
        self.made = False  # passed on to uvicorn's protocol (not refused at the cap)
        self._deadline: asyncio.TimerHandle | None = None
        self._heads = 0  # heads complete on this connection
        self._answered = 0  # of those, answered whole (Answered says)
        self._wrote_at_head = 0  # bytes written when the current request's head completed
        self._written = 0
        #: When the last request was answered, while no new one is arriving: the cap may close it.
        self.idle_since: float | None = None
        self._write_watch: asyncio.TimerHandle | None = None
        self._unsent = 0  # bytes in the write buffer when the write deadline was last armed

    # asyncio's Protocol interface

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # a stream transport (uvloop's is no subclass)
        self.peer = transport.get_extra_info("peername")
        door = self.door
        door.connections.add(self)
        over = door.max_connections is not None and len(door.connections) > door.max_connections
        if over and not door.make_room(self):
            transport.write(error_bytes(503, f"over {door.max_connections} connections at once; try again later"))
            transport.close()
            return
        self.made = True
        self.inner.connection_made(_Counted(transport, self))
        self._arm("headers", door.header_timeout_s)  # a client that connects and sends nothing, too

    def data_received(self, data: bytes) -> None:
        while data and not self.transport.is_closing():
            was = self.framing.phase
            try:
                step = self.framing.feed(data)
            except HeadTooLarge as refusal:  # before those bytes reach the parser, or are kept
                self._refuse(refusal.status, refusal.message)
                return
            if was == "idle":  # the first byte of the next request on a kept-alive connection
                self.idle_since = None
                if self._deadline is None:
                    self._arm("headers", self.door.header_timeout_s)
            piece, data = data[: step.used], data[step.used :]
            if step.head_done:
                self._heads += 1
                self._wrote_at_head = self._written
                self._arm("body", self.door.body_timeout_s)
            if step.request_done:
                self._disarm()
                if self._answered >= self._heads:  # answered before its body had all arrived
                    self.idle_since = self.loop.time()
            self.inner.data_received(piece)

    def eof_received(self) -> bool | None:
        return self.inner.eof_received() if self.made else None

    def connection_lost(self, exc: Exception | None) -> None:
        self.door.connections.discard(self)
        self._disarm()
        self._stop_write_watch()
        if self.made:
            self.inner.connection_lost(exc)

    def pause_writing(self) -> None:
        if self.made:
            self.inner.pause_writing()
        if self._write_watch is None:
            self._watch_writes()

    def resume_writing(self) -> None:
        self._stop_write_watch()
        if self.made:
            self.inner.resume_writing()

    # what the app says (Answered) and writes (_Counted)

    def answered(self) -> None:
        self._answered += 1
        if self._answered >= self._heads and self.framing.phase == "idle":
            self.idle_since = self.loop.time()

    def wrote(self, size: int) -> None:
        self._written += size

    # refusals and deadlines

    def _refuse(self, status: int, message: str) -> None:
        log.debug("refused a request from %s: %s", self.peer, message)
        self.transport.write(error_bytes(status, message))
        self.transport.close()

    def _arm(self, part: str, timeout_s: float) -> None:
        self._disarm()
        self._deadline = self.loop.call_later(timeout_s, self._expired, part, timeout_s)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
        self._deadline = None

    def _expired(self, part: str, timeout_s: float) -> None:
        self._deadline = None
        if self.transport.is_closing():
            return
        # A request whose app already answered gets no 408 after its answer. One still waiting for
        # its body reads a disconnect once the connection is closed (uvicorn's protocol is told).
        if part == "headers" or self._written == self._wrote_at_head:
            self.transport.write(
                error_bytes(408, f"the request {part} did not arrive within {timeout_s:g} s; send it faster")
            )
        log.debug("closed a connection from %s: request %s not complete after %g s", self.peer, part, timeout_s)
        self.transport.close()

    # the write deadline: transport flow control

    def _watch_writes(self) -> None:
        self._unsent = self.transport.get_write_buffer_size()
        self._write_watch = self.loop.call_later(self.door.write_timeout_s, self._write_due)

    def _stop_write_watch(self) -> None:
        if self._write_watch is not None:
            self._write_watch.cancel()
        self._write_watch = None

    def _write_due(self) -> None:
        self._write_watch = None
        unsent = self.transport.get_write_buffer_size()
        if unsent < self._unsent:  # the client reads, if slowly: it has another period
            self._watch_writes()
            return
        # Also when the transport is closing: close() waits for the buffer to drain, forever for a
        # client that does not read. abort() drops the buffer now and reports the connection lost,
        # so a streamed answer sees a disconnect and its request is cancelled.
        log.info(
            "aborted a connection from %s: the client read nothing of %d buffered bytes in %g s",
            self.peer, unsent, self.door.write_timeout_s,
        )
        sock = self.transport.get_extra_info("socket")
        if sock is not None:  # a reset, not a FIN queued behind the kernel's copy of the answer
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.transport.abort()


class _Counted(asyncio.Transport):
    """The transport as uvicorn's protocol sees it: the same one, with the bytes it writes counted
    (so a deadline knows whether the app had answered)."""

    def __init__(self, transport: asyncio.Transport, connection: Guarded) -> None:
        super().__init__()
        self._transport = transport
        self._connection = connection

    def write(self, data: Any) -> None:
        self._connection.wrote(len(data))
        self._transport.write(data)

    def writelines(self, list_of_data: Any) -> None:
        for data in list_of_data:
            self.write(data)

    # the rest is the transport's own

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return self._transport.get_extra_info(name, default)

    def is_closing(self) -> bool:
        return self._transport.is_closing()

    def close(self) -> None:
        self._transport.close()

    def abort(self) -> None:
        self._transport.abort()

    def pause_reading(self) -> None:
        self._transport.pause_reading()

    def resume_reading(self) -> None:
        self._transport.resume_reading()

    def is_reading(self) -> bool:
        return self._transport.is_reading()

    def get_write_buffer_size(self) -> int:
        return self._transport.get_write_buffer_size()

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        self._transport.set_write_buffer_limits(high, low)

    def can_write_eof(self) -> bool:
        return self._transport.can_write_eof()

    def write_eof(self) -> None:
        self._transport.write_eof()


class Answered:
    """ASGI middleware, outermost: tells a request's connection when its answer is complete."""

    def __init__(self, app: Callable[..., Awaitable[None]]) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        connection = scope.get("state", {}).get(CONNECTION) if scope["type"] == "http" else None
        if connection is None:
            await self.app(scope, receive, send)
            return

        async def sending(message: dict) -> None:
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                connection.answered()

        await self.app(scope, receive, sending)
