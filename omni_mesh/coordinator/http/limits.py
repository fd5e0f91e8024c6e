"""Limits on what one HTTP client may cost the coordinator: time to send a request, and its size.

uvicorn bounds idle keep-alive connections, but not a request that is still arriving: a client that
sends half a header, or trickles a body a byte at a time, holds its connection (and the task that
waits for the body) for as long as it likes, and a few hundred such clients wedge the front door.
`ReadDeadlines` gives every request two deadlines, checked below the ASGI app so they hold for every
route, whether or not it reads the body:

- headers: from the connection's start (or the first byte of the next request on a kept-alive one)
  until the headers are complete;
- body: from the end of the headers until the body is complete.

A request that misses one gets 408 and its connection is closed. Its head is bounded too: a URL over
MAX_URL_BYTES gets 414, a head (request line and headers) over MAX_HEAD_BYTES gets 431, and the
connection is closed as soon as the limit is passed, so a client sending megabytes of headers is
neither buffered nor parsed further (50 MB of headers on one connection stalled the event loop, and
every other client, for 12 s). `BodyLimit` answers 413 to bodies over the size limit before anything
parses them.

An answer has a deadline too: a client that stops reading leaves the answer in the transport's write
buffer, so once the buffer is over its high-water mark and has not shrunk for `write_timeout_s`, the
connection is aborted (its buffer freed at once) and the app sees the client go away (a stream ends,
its request is cancelled).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import struct
from collections.abc import Awaitable, Callable
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from omni_mesh.coordinator.http.envelope import error_bytes, error_response
from omni_mesh.defaults import BODY_TIMEOUT_S as BODY_TIMEOUT_S
from omni_mesh.defaults import HEADER_TIMEOUT_S as HEADER_TIMEOUT_S
from omni_mesh.defaults import WRITE_TIMEOUT_S as WRITE_TIMEOUT_S

log = logging.getLogger("omni_mesh.coordinator")

MAX_HEAD_BYTES = 64 * 1024
MAX_URL_BYTES = 8 * 1024
#: How long a kept-alive connection may wait for its next request: nginx's 75 s, not uvicorn's 5 s.
#: Longer than most clients keep an idle connection (httpx 5 s, aiohttp 15 s), so the client closes
#: first: a server closing just as the client sends on the connection is a reset, which the client
#: sees as a failed request (one came after a 7 s pause, issue 29). At the connection cap the
#: longest idle one is closed to make room (`_close_an_idle_one`): idle ones never lock clients out.
KEEP_ALIVE_S = 75.0


class _Refused(Exception):
    """Raised in a parser callback to stop parsing a request refused there (see send_400_response)."""


class ReadDeadlines(HttpToolsProtocol):
    """uvicorn's httptools protocol with a deadline on the headers and one on the body of each request,
    and one on the client's reading of an answer."""

    header_timeout_s: float = HEADER_TIMEOUT_S
    body_timeout_s: float = BODY_TIMEOUT_S
    #: Connections held at once; past it a new one is answered 503 and closed at once, so idle
    #: connections cannot take every descriptor (the control plane shares them). None: no cap.
    max_connections: int | None = None
    write_timeout_s: float = WRITE_TIMEOUT_S

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._deadline: asyncio.TimerHandle | None = None
        self._reading: str | None = None  # "headers" | "body" while a request is arriving
        self._head_bytes = 0  # fed to the parser since the last head was complete
        self._heads = 0  # heads complete on this connection
        self._refusal: tuple[int, str] | None = None  # what a parser callback refused the request with
        self._write_watch: asyncio.TimerHandle | None = None
        self._unsent = 0  # bytes in the write buffer when the write deadline was last armed

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        over = self.max_connections is not None and len(self.connections) > self.max_connections
        if over and not self._close_an_idle_one():
            transport.write(error_bytes(503, f"over {self.max_connections} connections at once; try again later"))
            transport.close()
            return
        self._arm("headers", self.header_timeout_s)  # a client that connects and sends nothing, too

    def _close_an_idle_one(self) -> bool:
        """Make room at the cap by closing a kept-alive connection waiting for its next request (the
        one idle longest): its client reconnects when it has one, as it would after the keep-alive
        timeout, while a new client would otherwise be refused. False if every connection is busy."""
        idle = [c for c in self.connections if c is not self and c.timeout_keep_alive_task is not None]
        if not idle:
            return False
        oldest = min(idle, key=lambda c: c.timeout_keep_alive_task.when())  # type: ignore[union-attr]
        oldest._unset_keepalive_if_required()
        oldest.transport.close()
        return True

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        self._stop_write_watch()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        """Feed the parser no more head bytes than MAX_HEAD_BYTES: httptools buffers a header until it
        is complete, so a huge one is refused here, by count, before it is parsed or kept."""
        while data and not self.transport.is_closing():
            if self._reading == "body":
                super().data_received(data)
                return
            room = MAX_HEAD_BYTES - self._head_bytes
            if room <= 0:
                self._refuse(431, f"the request's headers exceed {MAX_HEAD_BYTES} bytes")
                return
            piece, data = data[:room], data[room:]
            heads = self._heads
            super().data_received(piece)
            if self._heads == heads:  # all of it was head: count it (a head that completed reset the count)
                self._head_bytes += len(piece)

    def send_400_response(self, msg: str) -> None:
        if self._refusal is not None:  # a callback stopped the parser on purpose
            self._refuse(*self._refusal)
            return
        super().send_400_response(msg)

    def _refuse(self, status: int, message: str) -> None:
        log.debug("refused a request from %s: %s", self.client, message)
        self.transport.write(error_bytes(status, message))
        self.transport.close()
    # transport flow control: the write deadline

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._write_watch is None:
            self._watch_writes()

    def resume_writing(self) -> None:
        self._stop_write_watch()
        super().resume_writing()

    def _watch_writes(self) -> None:
        self._unsent = self.transport.get_write_buffer_size()
        self._write_watch = self.loop.call_later(self.write_timeout_s, self._write_due)

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
            self.client, unsent, self.write_timeout_s,
        )
        sock = self.transport.get_extra_info("socket")
        if sock is not None:  # a reset, not a FIN queued behind the kernel's copy of the answer
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.transport.abort()

    # httptools parser callbacks

    def on_message_begin(self) -> None:
        super().on_message_begin()
        if self._reading is None:  # the next request on a kept-alive connection
            self._arm("headers", self.header_timeout_s)

    def on_url(self, url: bytes) -> None:
        super().on_url(url)
        if len(self.url) > MAX_URL_BYTES:
            self._refusal = (414, f"the request's URL exceeds {MAX_URL_BYTES} bytes")
            raise _Refused

    def on_headers_complete(self) -> None:
        self._head_bytes = 0
        self._heads += 1
        self._arm("body", self.body_timeout_s)
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        self._disarm()
        super().on_message_complete()

    # deadlines

    def _arm(self, part: str, timeout_s: float) -> None:
        self._disarm()
        self._reading = part
        self._deadline = self.loop.call_later(timeout_s, self._expired, part, timeout_s)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
        self._deadline = None
        self._reading = None

    def _expired(self, part: str, timeout_s: float) -> None:
        self._deadline = None
        self._reading = None
        if self.transport.is_closing():
            return
        cycle = self.cycle if part == "body" else None
        if cycle is not None and not cycle.response_complete:
            # The app is waiting for the body: it now reads a disconnect, and anything it answers
            # is dropped rather than written after our 408.
            cycle.disconnected = True
            cycle.message_event.set()
        if cycle is None or not cycle.response_started:
            self.transport.write(
                error_bytes(408, f"the request {part} did not arrive within {timeout_s:g} s; send it faster")
            )
        log.debug("closed a connection from %s: request %s not complete after %g s", self.client, part, timeout_s)
        self.transport.close()


def read_deadlines(
    header_timeout_s: float,
    body_timeout_s: float,
    write_timeout_s: float = WRITE_TIMEOUT_S,
    *,
    max_connections: int | None = None,
) -> type[ReadDeadlines]:
    """The protocol class to give `uvicorn.Config(http=...)`, with these deadlines (and that cap)."""
    if header_timeout_s <= 0 or body_timeout_s <= 0:
        raise ValueError(f"read timeouts must be > 0 s, got headers {header_timeout_s} s, body {body_timeout_s} s")
    if not write_timeout_s > 0:
        raise ValueError(f"the write timeout must be > 0 s, got {write_timeout_s} s")
    attributes = {
        "header_timeout_s": header_timeout_s,
        "body_timeout_s": body_timeout_s,
        "write_timeout_s": write_timeout_s,
        "max_connections": max_connections,
    }
    return type("ReadDeadlinesProtocol", (ReadDeadlines,), attributes)


class BodyLimit:
    """Answer 413 to request bodies over `limit` bytes, declared or streamed, before anything parses them."""

    def __init__(self, app: Callable[..., Awaitable[None]], limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            await self._too_large(scope, receive, send)
            return
        messages, total = [], 0
        while True:
            message = await receive()
            messages.append(message)
            total += len(message.get("body", b""))
            if total > self.limit:
                await self._too_large(scope, receive, send)
                return
            if message["type"] != "http.request" or not message.get("more_body"):
                break
        replay = iter(messages)

        async def replayed() -> dict:
            return next(replay, None) or await receive()

        await self.app(scope, replayed, send)

    async def _too_large(self, scope: dict, receive: Callable, send: Callable) -> None:
        # The rest of the body is read and dropped below us (a client mid-upload could not read an
        # answer on a connection closed under it); ReadDeadlines bounds how long that may take.
        await error_response(413, f"request body exceeds {self.limit} bytes")(scope, receive, send)
