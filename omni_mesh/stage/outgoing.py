"""A replica's messages to one coordinator, sent together: every message handed over in one turn of the
event loop goes in one ZeroMQ multipart message (omni_mesh.control_parts), in order.

A running batch hands a token of each of its requests to the loop at once, and each request's task
sends its output message: one send each would wake ZeroMQ's I/O thread, seal a box and wake the
coordinator once per token. Sent together, it is once per step. The first message of a turn schedules
the flush; the ones after it join it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

import zmq

from omni_mesh import control_parts

log = logging.getLogger("omni_mesh.stage")

#: Messages waiting past this many make their senders wait for the socket (it is not taking them: the
#: coordinator is not reading), as a send to a full socket would.
MAX_WAITING = 4 * control_parts.MAX_MESSAGES


class Outgoing:
    """Packed messages, with their frames, for one socket (module docstring)."""

    def __init__(self, socket: Any, name: str) -> None:
        self.socket = socket  # a zmq.asyncio socket
        self.name = name  # whose messages, for the log
        self.waiting: list[tuple[bytes, Any]] = []
        self.flushing: asyncio.Task | None = None
        self.sends = 0  # multipart messages sent (/ messages: how many went together)
        self.messages = 0

    async def send(self, packed: bytes, frame: Any = None) -> None:
        """Queue `packed` (and its frame) for the next flush; waits only while the socket takes none."""
        self.waiting.append((packed, frame))
        if self.flushing is None or self.flushing.done():
            self.flushing = asyncio.ensure_future(self._flush())
        if len(self.waiting) > MAX_WAITING:
            await asyncio.shield(self.flushing)

    async def _flush(self) -> None:
        while self.waiting:
            batch = self.waiting[: control_parts.MAX_MESSAGES]
            del self.waiting[: len(batch)]
            try:
                await self.socket.send_multipart(control_parts.join(batch), copy=False)
            except zmq.ZMQError as exc:  # closed under it (the replica stops); a Reconcile resends
                log.debug("%s: %d control messages not sent: %s", self.name, len(batch), exc)
                return
            self.sends += 1
            self.messages += len(batch)

    async def flushed(self, timeout_s: float) -> None:
        """Wait (up to `timeout_s`) until what is queued has gone to the socket: before it closes."""
        if self.flushing is not None and not self.flushing.done():
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(asyncio.shield(self.flushing), timeout_s)

    def close(self) -> None:
        if self.flushing is not None:
            self.flushing.cancel()
