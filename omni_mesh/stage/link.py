"""A replica's link to the coordinator: the control-plane socket, registering, the heartbeat clock,
and the connector health the heartbeats carry.

Registration repeats every second until the coordinator answers, or until the replica is told to
stop: a replica whose coordinator is gone (`docker compose down` stops it first) exits on SIGTERM at
once instead of waiting for an answer that never comes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import msgpack
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from omni_mesh import control
from omni_mesh.connectors import OmniConnectorBase
from omni_mesh.control import Message, Register, Registered
from omni_mesh.defaults import HEARTBEAT_S as HEARTBEAT_S
from omni_mesh.security import mesh_keys, secure_client
from omni_mesh.stage.outgoing import Outgoing

log = logging.getLogger("omni_mesh.stage")

_STATUSES = ("healthy", "degraded", "unhealthy")  # a connector's health()["status"] (connectors.base)

CONNECT_TIMEOUT_MS = 1000  # a TCP connect to the coordinator, across any network we run on: milliseconds
HEALTH_WAIT_S = 0.25  # longest a heartbeat waits for connector health (a backend RPC) before sending


class CoordinatorLink:
    """The replica's DEALER socket to the coordinator's control endpoint (CURVE with the mesh's keys)."""

    def __init__(self, coordinator: str, replica_id: str) -> None:
        self.coordinator = coordinator
        self.replica_id = replica_id
        self.heartbeat_s = HEARTBEAT_S
        self.registered = asyncio.Event()
        self.down = False  # the connection dropped and is not back yet
        self.drained = False  # this coordinator says no running request needs us any more
        self._monitor: zmq.asyncio.Socket | None = None  # watches for reconnects (`reconnects`)
        self._ctx = zmq.asyncio.Context()
        self._socket = self._ctx.socket(zmq.DEALER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(
            zmq.MAXMSGSIZE, control.MAX_MESSAGE_BYTES
        )  # the coordinator sends metadata only
        # Our own random routing id (128 bits, never sent in clear: CURVE encrypts the handshake), kept
        # across reconnects: a dropped connection that comes back is still us to the coordinator at
        # once (it hands the id over to the new connection), while nobody else can guess it. ZeroMQ's
        # own ids change on every connection and are a counter.
        self._socket.setsockopt(zmq.ROUTING_ID, routing_id())
        # A connect unanswered this long is given up and made again: a SYN dropped by a full accept
        # queue (a flood, a coordinator standing still) is otherwise retried by the kernel at doubling
        # intervals, for minutes (issue 29), however soon the queue has room again.
        self._socket.setsockopt(zmq.CONNECT_TIMEOUT, CONNECT_TIMEOUT_MS)
        secure_client(self._socket, mesh_keys())
        self._socket.connect(coordinator)
        self._outgoing = Outgoing(self._socket, f"replica {replica_id}")

    async def send(self, message: Message, *extra: Any) -> None:
        """`message` (and a final output's frame), sent with the others of this turn of the loop."""
        if len(extra) > 1:
            raise ValueError(f"a control message carries one frame at most, not {len(extra)}")
        await self._outgoing.send(control.pack(message), extra[0] if extra else None)

    async def flushed(self, timeout_s: float = 1.0) -> None:
        """What was sent has left for the socket (a last message before close)."""
        await self._outgoing.flushed(timeout_s)

    async def receive(self) -> list[Any]:
        return await self._socket.recv_multipart()

    async def reconnects(
        self, back: Callable[[], Awaitable[None]], dropped: Callable[[], None] | None = None
    ) -> None:
        """Run `back` each time our connection comes back after it dropped (until cancelled): ZeroMQ
        reconnects on its own, but messages in flight when it dropped are lost both ways. `dropped`
        is called when it drops (`down` says whether it is down now)."""
        monitor = self._monitor = self._socket.get_monitor_socket(
            zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED
        )
        while True:
            event = parse_monitor_message(await monitor.recv_multipart())["event"]
            if event == zmq.EVENT_DISCONNECTED:
                self.down = True
                if dropped is not None:
                    dropped()
            elif self.down:  # the handshake on the new connection (CURVE or not) succeeded
                self.down = False
                try:
                    await back()
                except Exception:  # a failed resync must not end the watch: the next drop retries
                    log.exception("replica %s: reconciling after a reconnect failed", self.replica_id)

    def accepted(self, message: Registered) -> None:
        """The coordinator registered us, and says how often to heartbeat."""
        self.heartbeat_s = min(max(float(message.heartbeat_s), 0.05), 5.0)
        self.registered.set()

    async def register(self, message: Register, stopped: asyncio.Event) -> bool:
        """Send `message` every second until the coordinator answers or `stopped` is set; whether it
        answered."""
        while not self.registered.is_set() and not stopped.is_set():
            await self.send(message)
            await _first_set(self.registered, stopped, timeout_s=1.0)
            if not self.registered.is_set() and not stopped.is_set():
                log.info("replica %s waiting for the coordinator at %s", self.replica_id, self.coordinator)
        return self.registered.is_set()

    async def heartbeats(self, beat: Callable[[], Awaitable[None]]) -> None:
        """Run `beat` every heartbeat interval while registered (until cancelled)."""
        while True:
            await asyncio.sleep(self.heartbeat_s)
            if self.registered.is_set():
                await beat()

    def close(self) -> None:
        self._outgoing.close()
        if self._monitor is not None:
            with contextlib.suppress(zmq.ZMQError):
                self._socket.disable_monitor()
            self._monitor.close(0)  # before term(), which waits for every socket
        self._socket.close(0)
        self._ctx.term()


def routing_id() -> bytes:
    """A fresh random routing id: 32 hex digits (never starts with a zero byte, which ZeroMQ reserves)."""
    return secrets.token_hex(16).encode()


async def _first_set(*events: asyncio.Event, timeout_s: float) -> None:
    """Wait until one of `events` is set, or `timeout_s` passes."""
    waits = [asyncio.ensure_future(event.wait()) for event in events]
    try:
        await asyncio.wait(waits, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for wait in waits:
            wait.cancel()


class ConnectorHealth:
    """The connectors' health for registration and heartbeats, read on a thread of its own:
    heartbeats must not wait behind long transfers in the I/O pool."""

    def __init__(self, connectors: dict[str, OmniConnectorBase], replica_id: str, thread_prefix: str) -> None:
        self._connectors = connectors
        self._replica_id = replica_id
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=thread_prefix)
        # The latest reading, refreshed beside the heartbeats: a heartbeat never waits for it (a
        # backend RPC can stall behind busy transfers, and a late heartbeat reads as a dead replica).
        self._latest: dict[str, dict] = {}
        self._refresh: asyncio.Task | None = None

    async def read(self) -> dict[str, dict]:
        """In the thread pool: some connectors ask their backend (a datasystem worker RPC)."""
        loop = asyncio.get_running_loop()
        report = await loop.run_in_executor(
            self._executor, lambda: {ref: c.health() for ref, c in self._connectors.items()}
        )
        return self._bounded(report)

    def _bounded(self, report: dict[str, Any]) -> dict[str, Any]:
        """The report, or only each connector's status where it is too large for a heartbeat
        (control.MAX_STATE_BYTES, half of it for the health): the coordinator would drop it, and
        the replica would go silent."""
        size = len(msgpack.packb(report, default=repr))
        if size <= control.MAX_STATE_BYTES // 2:
            return report
        log.warning("replica %s: connector health of %d bytes is too large for heartbeats; sending only "
                    "each connector's status", self._replica_id, size)
        note = f"health report of {size} bytes, over {control.MAX_STATE_BYTES // 2}: only its status is sent"
        statuses = {ref: h.get("status") if isinstance(h, dict) else None for ref, h in report.items()}
        return {
            ref: {"status": status if status in _STATUSES else "unknown", "error": note}
            for ref, status in statuses.items()
        }

    async def latest(self) -> dict[str, dict]:
        """Fresh connector health, or the last one read if the read stalls: a heartbeat waits for it
        HEALTH_WAIT_S at most (the read goes on, and the next heartbeat does not start another)."""
        if self._refresh is None or self._refresh.done():
            self._refresh = asyncio.ensure_future(self._refresh_latest())
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(self._refresh), timeout=HEALTH_WAIT_S)
        return self._latest

    async def _refresh_latest(self) -> None:
        try:
            self._latest = await self.read()
        except Exception as exc:  # a connector's health() failing must not take the heartbeats along
            log.warning("replica %s: reading connector health failed: %s", self._replica_id, exc)

    def close(self) -> None:
        if self._refresh is not None:
            self._refresh.cancel()
        self._executor.shutdown(wait=False, cancel_futures=True)
