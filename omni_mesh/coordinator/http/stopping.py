"""Stopping past the grace: the requests still running end with a 503 saying the server is stopping.

uvicorn cancels whatever still runs when its graceful-shutdown timeout passes: a stream would then be
cut with no event at all, its request blamed on a client that went away (499), and each cancelled
task logged with a CancelledError traceback. Just before that timeout the coordinator fails those
requests itself: a stream gets an `error` event, a waiting client a 503, each naming the stop, and
the answers finish within the grace, so uvicorn has nothing left to cancel.

It watches the server from beside it, through `uvicorn.Server`'s public `should_exit` (set when a
signal asks it to stop; its grace starts within a tick of it): no subclass overriding its shutdown.
"""

from __future__ import annotations

import asyncio
import logging
import socket

import uvicorn

from omni_mesh.coordinator.scheduling.dispatch import Dispatcher
from omni_mesh.coordinator.scheduling.failures import RequestFailed

log = logging.getLogger("omni_mesh.coordinator")

#: How long before the grace ends the requests are failed: time for their answers to go out.
MARGIN_S = 1.0
#: How often the server's should_exit is looked at (uvicorn looks every 0.1 s).
POLL_S = 0.05


async def serve_ending_requests_at_grace(
    server: uvicorn.Server, dispatcher: Dispatcher, sockets: list[socket.socket] | None = None
) -> None:
    """`server.serve()` (on `sockets`, bound already, if given); once it is told to stop, the requests
    still running past its grace (less MARGIN_S) end with 503."""
    ender = asyncio.create_task(_end_requests_at_grace(server, dispatcher))
    try:
        await server.serve(sockets=sockets)
    finally:
        ender.cancel()


async def _end_requests_at_grace(server: uvicorn.Server, dispatcher: Dispatcher) -> None:
    while not server.should_exit:
        await asyncio.sleep(POLL_S)
    grace = float(server.config.timeout_graceful_shutdown or 0.0)
    await asyncio.sleep(max(0.0, grace - min(MARGIN_S, grace / 4)))
    running = list(dispatcher.requests.values())
    if not running:
        return
    log.warning("server stopping: its grace of %g s is over; ending the %d request(s) still running", grace,
                len(running))
    stopping = RequestFailed(503, f"the server is stopping (its grace of {grace:g} s is over); retry the request")
    for state in running:
        dispatcher.fail(state, stopping)
