"""The coordinator's control side: one ROUTER socket all replicas talk to, and a monitor loop."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

import zmq
import zmq.asyncio

from omni_mesh import control
from omni_mesh.coordinator.dispatch import Dispatcher
from omni_mesh.coordinator.registry import Registry, Replica
from omni_mesh.topology import Topology

log = logging.getLogger("omni_mesh.coordinator")

HEARTBEAT_S = 0.5
MONITOR_S = 0.05


class Coordinator:
    def __init__(
        self,
        topology: Topology,
        control_endpoint: str,
        *,
        heartbeat_timeout_s: float = 5.0,
        default_timeout_s: float = 30.0,
        max_timeout_s: float = 3600.0,
    ) -> None:
        self.topology = topology
        self.control_endpoint = control_endpoint
        self.default_timeout_s = default_timeout_s
        self.max_timeout_s = max_timeout_s
        self.registry = Registry(topology, heartbeat_timeout_s)
        self.dispatcher = Dispatcher(topology, self.registry, self.send)
        self.malformed = 0
        self._ctx: zmq.asyncio.Context | None = None
        self._socket: zmq.asyncio.Socket | None = None
        self._tasks: list[asyncio.Task] = []

    async def start(self) -> None:
        self._ctx = zmq.asyncio.Context()
        self._socket = self._ctx.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.ROUTER_MANDATORY, 0)  # a vanished replica must not stall us
        self._socket.bind(self.control_endpoint)
        self.control_endpoint = self._socket.getsockopt(zmq.LAST_ENDPOINT).decode()
        self._tasks = [asyncio.create_task(self._receive_loop()), asyncio.create_task(self._monitor_loop())]
        log.info("coordinator control plane on %s", self.control_endpoint)

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        if self._socket is not None:
            # Every request has ended by now: no replica's outputs are needed any more, so none has
            # to wait for us when it drains (`omni-mesh up` stops the replicas after us).
            for replica in list(self.registry.replicas.values()):
                with contextlib.suppress(zmq.ZMQError):
                    self.send(replica, {"type": "drained", "replica": replica.replica_id})
            self._socket.close(linger=500)  # long enough to hand those few bytes to the kernel
        if self._ctx is not None:
            self._ctx.term()

    def send(self, replica: Replica, message: dict[str, Any]) -> None:
        assert self._socket is not None
        self._socket.send_multipart([replica.identity, control.pack(message)])

    def _reply(self, identity: bytes, message: dict[str, Any]) -> None:
        assert self._socket is not None
        self._socket.send_multipart([identity, control.pack(message)])

    async def _receive_loop(self) -> None:
        assert self._socket is not None
        while True:
            frames = await self._socket.recv_multipart()
            try:
                if len(frames) < 2:
                    raise control.MalformedMessage("control message without a body")
                self._handle(frames[0], control.unpack(frames[1]), frames[2] if len(frames) > 2 else None)
            except control.MalformedMessage as exc:
                self.malformed += 1
                log.warning("dropped a control message: %s", exc)
            except Exception:
                log.exception("error handling a control message")

    def _handle(self, identity: bytes, message: dict[str, Any], frame: bytes | None) -> None:
        kind = message["type"]
        if kind == "register":
            self._register(identity, message)
            return
        replica = self.registry.replicas.get(message.get("replica", ""))
        if replica is None:
            if kind == "heartbeat":  # we restarted, or declared it dead: ask it to register again
                self._reply(identity, {"type": "rejected", "replica": message["replica"], "error": "unknown replica", "reregister": True})
            return
        if kind == "heartbeat":
            self.registry.heartbeat(message)
            if replica.draining and not self.dispatcher.holds(replica.replica_id):
                self.send(replica, {"type": "drained", "replica": replica.replica_id})
            self.dispatcher.drain_queue(replica.stage)
        elif kind == "output":
            self.dispatcher.on_output(replica, message, frame)
        elif kind == "error":
            self.dispatcher.on_error(replica, message)
        elif kind == "deregister":
            self.registry.remove(replica.replica_id)
            self.dispatcher.replica_lost(replica, "left")
            log.info("replica %s of stage %s deregistered", replica.replica_id, replica.stage)
        else:
            self.malformed += 1

    def _register(self, identity: bytes, message: dict[str, Any]) -> None:
        previous = self.registry.replicas.get(message["replica"])
        try:
            replica = self.registry.register(message, identity)
        except ValueError as exc:
            log.error("rejected replica %s: %s", message["replica"], exc)
            self._reply(identity, {"type": "rejected", "replica": message["replica"], "error": str(exc)})
            return
        if replica is previous:  # the same process registering again: just confirm
            self._reply(identity, {"type": "registered", "replica": replica.replica_id, "heartbeat_s": HEARTBEAT_S})
            return
        if previous is not None and previous.pid != replica.pid:
            self.dispatcher.replica_lost(replica, f"restarted (pid {previous.pid} -> {replica.pid})")
        self._reply(identity, {"type": "registered", "replica": replica.replica_id, "heartbeat_s": HEARTBEAT_S})
        restart = f" (restart #{replica.restarts})" if replica.restarts else ""
        log.info("replica %s of stage %s registered from %s pid %d%s", replica.replica_id, replica.stage, replica.host, replica.pid, restart)
        self.dispatcher.drain_queue(replica.stage)

    async def _monitor_loop(self) -> None:
        while True:
            await asyncio.sleep(MONITOR_S)
            try:
                self.dispatcher.expire()
                for replica in self.registry.dead():
                    self._bury(replica)
            except Exception:
                log.exception("monitor loop error")

    def _bury(self, replica: Replica) -> None:
        self.registry.remove(replica.replica_id)
        reason = f"died (pid {replica.pid})" if replica.local_process_gone() else "stopped sending heartbeats"
        self.dispatcher.replica_lost(replica, reason)
        reaped = self.registry.reap_segments(replica)
        log.warning(
            "replica %s of stage %s %s; removed%s",
            replica.replica_id, replica.stage, reason, f", reaped {len(reaped)} shared-memory segment(s)" if reaped else "",
        )
