"""Stopping past the grace: the requests still running end with a 503 saying the server is stopping.

uvicorn cancels whatever still runs when its graceful-shutdown timeout passes: a stream would then be
cut with no event at all, its request blamed on a client that went away (499), and each cancelled
task logged with a CancelledError traceback. Just before that timeout the coordinator fails those
requests itself: a stream gets an `error` event, a waiting client a 503, each naming the stop, and
the answers finish within the grace, so uvicorn has nothing left to cancel.
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


class StoppingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, dispatcher: Dispatcher) -> None:
        super().__init__(config)
        self.dispatcher = dispatcher

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        grace = float(self.config.timeout_graceful_shutdown or 0.0)
        ender = asyncio.create_task(self._end_requests_after(grace, max(0.0, grace - min(MARGIN_S, grace / 4))))
        try:
            await super().shutdown(sockets)
        finally:
            ender.cancel()

    async def _end_requests_after(self, grace: float, delay_s: float) -> None:
        await asyncio.sleep(delay_s)
        running = list(self.dispatcher.requests.values())
        if not running:
            return
        log.warning("server stopping: its grace of %g s is over; ending the %d request(s) still running", grace,
                    len(running))
        stopping = RequestFailed(503, f"the server is stopping (its grace of {grace:g} s is over); retry the request")
        for state in running:
            self.dispatcher.fail(state, stopping)
