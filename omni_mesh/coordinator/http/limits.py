"""Limits on what one HTTP client may cost the coordinator: time to send a request, and its size.

uvicorn bounds idle keep-alive connections, but not a request that is still arriving: a client that
sends half a header, or trickles a body a byte at a time, holds its connection (and the task that
waits for the body) for as long as it likes, and a few hundred such clients wedge the front door.
`read_deadlines` gives every request two deadlines, checked below the ASGI app so they hold for every
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

How: uvicorn has no option for any of these (`h11_max_incomplete_event_size` bounds a head but
answers 400, on the slower h11 parser; `limit_concurrency` answers 503 per request and never closes an
idle connection; an ASGI middleware runs only once a head is complete). So the connection's protocol
keeps them (front_door.py), wrapping uvicorn's own parser rather than subclassing it.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from omni_mesh.coordinator.http.envelope import error_response
from omni_mesh.coordinator.http.front_door import FrontDoor
from omni_mesh.defaults import BODY_TIMEOUT_S as BODY_TIMEOUT_S
from omni_mesh.defaults import HEADER_TIMEOUT_S as HEADER_TIMEOUT_S
from omni_mesh.defaults import WRITE_TIMEOUT_S as WRITE_TIMEOUT_S

MAX_HEAD_BYTES = 64 * 1024
MAX_URL_BYTES = 8 * 1024
#: How long a kept-alive connection may wait for its next request: nginx's 75 s, not uvicorn's 5 s.
#: Longer than most clients keep an idle connection (httpx 5 s, aiohttp 15 s), so the client closes
#: first: a server closing just as the client sends on the connection is a reset, which the client
#: sees as a failed request (one came after a 7 s pause, issue 29). At the connection cap the
#: longest idle one is closed to make room (`FrontDoor.make_room`): idle ones never lock clients out.
KEEP_ALIVE_S = 75.0


def read_deadlines(
    header_timeout_s: float,
    body_timeout_s: float,
    write_timeout_s: float = WRITE_TIMEOUT_S,
    *,
    max_connections: int | None = None,
) -> FrontDoor:
    """The protocol factory to give `uvicorn.Config(http=...)`, with these deadlines (and that cap; an
    app served with a cap needs `Answered` outermost, or no connection is ever idle enough to close)."""
    if header_timeout_s <= 0 or body_timeout_s <= 0:
        raise ValueError(f"read timeouts must be > 0 s, got headers {header_timeout_s} s, body {body_timeout_s} s")
    if not write_timeout_s > 0:
        raise ValueError(f"the write timeout must be > 0 s, got {write_timeout_s} s")
    return FrontDoor(
        header_timeout_s=header_timeout_s, body_timeout_s=body_timeout_s, write_timeout_s=write_timeout_s,
        max_head_bytes=MAX_HEAD_BYTES, max_url_bytes=MAX_URL_BYTES, max_connections=max_connections,
    )


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
        # answer on a connection closed under it); read_deadlines bounds how long that may take.
        await error_response(413, f"request body exceeds {self.limit} bytes")(scope, receive, send)
