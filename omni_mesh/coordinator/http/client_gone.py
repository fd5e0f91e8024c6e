"""A non-streaming answer waits for its request while watching its client: one that goes away ends the
request, so no stage keeps working for nobody (streamed answers notice it when a write fails)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any, TypeVar

from fastapi import Request

T = TypeVar("T")


class ClientGone(Exception):
    """The client closed its connection before its answer was ready."""


async def unless_client_leaves(request: Request, work: Awaitable[T]) -> T:
    """`work`'s result, or ClientGone when the client disconnects first. A coroutine given as `work` is
    cancelled then; a future is left as it is (its owner ends it)."""
    job: asyncio.Future[Any] = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({job, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if job.done():
            return job.result()
        if asyncio.iscoroutine(work):
            job.cancel()
        raise ClientGone
    finally:
        watcher.cancel()


async def _disconnected(request: Request) -> None:
    """Returns once the ASGI server says the client went away (the body was read already: what it
    sends now is only that)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
