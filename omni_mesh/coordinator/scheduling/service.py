"""The coordinator's control side: one ROUTER socket all replicas talk to, and a monitor loop.

With mesh keys (the default: `omni_mesh.security`) the socket is a CURVE server and a ZAP handler on
its context admits only holders of this mesh's keys. A replica id belongs to the connection that
registered it: anything another connection sends in its name is dropped and counted, and an output or
error counts only from the replica the request was sent to at that stage.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import resource
import uuid

import zmq
import zmq.asyncio

from omni_mesh import control, control_parts
from omni_mesh.control import (
    Abort,
    Deregister,
    Drained,
    Error,
    Heartbeat,
    Holding,
    Message,
    Output,
    Register,
    Registered,
    Rejected,
    Resync,
)
from omni_mesh.coordinator.scheduling.autoscaler import Autoscaler
from omni_mesh.coordinator.scheduling.connection_cap import (
    MAX_CONTROL_CONNECTIONS,
    ConnectionCap,
    default_cap,
)
from omni_mesh.coordinator.scheduling.dispatch import Dispatcher, RequestFailed
from omni_mesh.coordinator.scheduling.metrics import Metrics
from omni_mesh.coordinator.scheduling.peers import Peers
from omni_mesh.coordinator.scheduling.reconcile import Reconciler
from omni_mesh.coordinator.scheduling.registry import (
    HEARTBEAT_TIMEOUT_S,
    RegistrationRefused,
    Registry,
    Replica,
)
from omni_mesh.defaults import HEARTBEAT_S as HEARTBEAT_S
from omni_mesh.defaults import INSTANCE_ENV as INSTANCE_ENV
from omni_mesh.ingress import Ingress
from omni_mesh.logs import Sparse
from omni_mesh.media.limits import MediaLimits
from omni_mesh.security import MeshKeys, Refusals, bind_zap, mesh_keys, secure_server, zap_reply
from omni_mesh.topology import Topology

log = logging.getLogger("omni_mesh.coordinator")

_FROM_STAGES = (Register, Heartbeat, Output, Error, Deregister, Resync, Holding)  # what a replica may send

MONITOR_S = 0.05
HANDSHAKE_MS = 5000  # a replica's handshake takes milliseconds; ZeroMQ's default waits 30 s
REAP_CHECK_S = 1.0  # how often silent replicas are checked for a process that has since died


class Coordinator:
    def __init__(
        self,
        topology: Topology,
        control_endpoint: str,
        *,
        heartbeat_timeout_s: float = HEARTBEAT_TIMEOUT_S,
        default_timeout_s: float = 30.0,
        max_timeout_s: float = 3600.0,
        keys: MeshKeys | None | object = ...,
        max_connections: int | None = None,
        media_limits: MediaLimits | None = None,
    ) -> None:
        self.topology = topology
        #: What one media part may cost (the operator's; OMNI_MESH_MEDIA_* unless given).
        self.media_limits = media_limits or MediaLimits.from_env()
        self.control_endpoint = control_endpoint
        self.default_timeout_s = default_timeout_s
        self.max_timeout_s = max_timeout_s
        self.keys: MeshKeys | None = mesh_keys() if keys is ... else keys  # type: ignore[assignment]
        #: Names this coordinator in /ready, so `omni-mesh up` knows it is its own answering, not
        #: another mesh's on the same port.
        self.instance = os.environ.get(INSTANCE_ENV) or uuid.uuid4().hex
        #: With several coordinators (`up --coordinators N`): ours, and every one's status (peers.py).
        self.peers = Peers()
        several = self.peers.coordinator_id is not None
        self.registry = Registry(topology, heartbeat_timeout_s, shared=several)
        self.metrics = Metrics(self)  # reads the registry and dispatcher when scraped, not before
        # Large inputs' connector: it listens on the control plane's host (known before the bind).
        self.ingress = Ingress(control_endpoint)
        self.dispatcher = Dispatcher(
            topology, self.registry, self.send, ingress=self.ingress, observer=self.metrics.observe_request,
            rid_prefix=f"{self.peers.name}." if several else "",
        )
        self.reconciler = Reconciler(self.dispatcher, self.send)  # after a replica's connection drops
        self.autoscaler = Autoscaler(topology, self.registry, self.dispatcher)  # decides; `up` acts
        self.malformed = 0
        self.forged = Refusals("coordinator control plane")  # messages sent in another connection's name
        # Every control connection refused: handshakes without the mesh keys, connections over the cap.
        self.refused_connections = Refusals("coordinator control plane")
        self.max_connections = max_connections or default_cap(resource.getrlimit(resource.RLIMIT_NOFILE)[0])
        self.cap: ConnectionCap | None = None
        self._garbage = Refusals("coordinator control plane")  # for rate-limited logging only
        # A failure that recurs every tick (out of file descriptors) logs its traceback once a minute.
        self._monitor_errors = Sparse(log)
        self._handling_errors = Sparse(log)
        self._ctx: zmq.asyncio.Context | None = None
        self._socket: zmq.asyncio.Socket | None = None
        self._zap: zmq.asyncio.Socket | None = None
        self._tasks: list[asyncio.Task] = []

    async def start(self) -> None:
        self._ctx = zmq.asyncio.Context()
        self._zap = bind_zap(self._ctx, self.keys)
        self._socket = self._ctx.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.ROUTER_MANDATORY, 0)  # a vanished replica must not stall us
        # A replica's routing id is its own random secret (stage.link.routing_id): when its connection
        # drops and comes back under the same id, the new connection takes over at once, even before
        # we noticed the old one was gone. Only ids ZeroMQ makes itself (a counter) are guessable, and
        # no replica uses one.
        self._socket.setsockopt(zmq.ROUTER_HANDOVER, 1)
        self._socket.setsockopt(zmq.MAXMSGSIZE, control.MAX_FRAME_BYTES)
        self._socket.setsockopt(zmq.HANDSHAKE_IVL, HANDSHAKE_MS)  # a connection that never speaks goes soon
        # Room in the accept queue for every replica reconnecting at once (ZeroMQ's default is 100;
        # the kernel caps it at net.core.somaxconn): past it their SYNs are dropped until it drains.
        self._socket.setsockopt(zmq.BACKLOG, MAX_CONTROL_CONNECTIONS)
        self.cap = ConnectionCap(self._socket, self.max_connections, self.refused_connections)
        secure_server(self._socket, self.keys)
        self._socket.bind(self.control_endpoint)
        self.control_endpoint = self._socket.getsockopt(zmq.LAST_ENDPOINT).decode()
        self._tasks = [
            asyncio.create_task(self._receive_loop()),
            asyncio.create_task(self._monitor_loop()),
            asyncio.create_task(self.cap.run()),
            asyncio.create_task(self.autoscaler.run()),
            asyncio.create_task(self.peers.run(self.status)),
        ]
        self.peers.ports["control"] = self.control_endpoint
        if self._zap is not None:
            self._tasks.append(asyncio.create_task(self._zap_loop()))
        security = "CURVE, mesh keys only" if self.keys else "NO authentication (insecure)"
        log.info("coordinator control plane on %s (%s)", self.control_endpoint, security)

    def status(self) -> dict:
        """Our line in /v1/coordinators: requests served (ended, either way) and in flight."""
        return self.peers.describe(self.dispatcher.completed + self.dispatcher.failed, len(self.dispatcher.requests))

    async def stop(self) -> None:
        self.peers.close()
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        if self.cap is not None and self._socket is not None:
            self.cap.close(self._socket)
        if self._socket is not None:
            # Every request has ended by now: no replica's outputs are needed any more, so none has
            # to wait for us when it drains (`omni-mesh up` stops the replicas after us).
            for replica in list(self.registry.replicas.values()):
                with contextlib.suppress(zmq.ZMQError):
                    self.send(replica, Drained(replica.replica_id))
            self._socket.close(linger=500)  # long enough to hand those few bytes to the kernel
        if self._zap is not None:
            self._zap.close(linger=0)
        self.ingress.close()
        if self._ctx is not None:
            self._ctx.term()

    def send(self, replica: Replica, message: Message) -> None:
        self._reply(replica.identity, message)

    def _reply(self, identity: bytes, message: Message) -> None:
        assert self._socket is not None
        self._socket.send_multipart([identity, control.pack(message)])

    async def _zap_loop(self) -> None:
        assert self._zap is not None and self.keys is not None
        while True:
            request = await self._zap.recv_multipart()
            await self._zap.send_multipart(zap_reply(request, self.keys, self.refused_connections))

    async def _receive_loop(self) -> None:
        assert self._socket is not None
        while True:
            # Not copied into bytes: a final output's frame (up to MAX_FRAME_BYTES) is decoded
            # straight from libzmq's buffer, which goes when the frames do (before the next wait).
            frames = await self._socket.recv_multipart(copy=False)
            identity = frames[0].bytes
            try:
                if len(frames) < 2:
                    raise control.MalformedMessage("control message without a body")
                try:  # one message, or several sent together (omni_mesh.control_parts)
                    messages = control_parts.split(frames[1:])
                except ValueError as exc:
                    raise control.MalformedMessage(f"control messages: {exc}") from None
            except control.MalformedMessage as exc:
                self._unreadable(identity, exc)
                messages = []
            for raw, frame in messages:
                output = None
                try:
                    # zmq Frames, or views into a bundle of several (control_parts)
                    output = frame.buffer if isinstance(frame, zmq.Frame) else frame
                    self._handle(identity, control.unpack(raw.bytes if isinstance(raw, zmq.Frame) else raw), output)
                except control.MalformedMessage as exc:
                    self._unreadable(identity, exc)
                except Exception:
                    self._handling_errors.exception("error handling a control message")
                finally:
                    del raw, frame, output
            del frames, messages

    def _unreadable(self, identity: bytes, exc: control.MalformedMessage) -> None:
        self.malformed += 1
        self._garbage.refuse(f"a control message: {exc}")
        self._fail_unreadable(identity, exc)

    def _fail_unreadable(self, identity: bytes, exc: control.MalformedMessage) -> None:
        """A replica's message about a request we cannot read: fail that request now, not at its deadline."""
        replica = self.registry.owner(identity)
        state = self.dispatcher.requests.get(exc.rid) if exc.rid else None
        if replica is None or state is None or state.at.get(replica.stage) != replica.replica_id:
            return
        message = f"stage {replica.stage!r} replica {replica.replica_id!r} sent an unreadable message: {exc}"
        self.dispatcher.fail(state, RequestFailed(502, message, replica.stage))

    def _handle(self, identity: bytes, message: Message, frame: memoryview | None) -> None:
        if not isinstance(message, _FROM_STAGES):
            self.malformed += 1
            self._garbage.refuse(f"a {message.TYPE} message, which only the coordinator sends")
            return
        if isinstance(message, Register):
            self._register(identity, message)
            return
        replica_id = getattr(message, "replica", None)
        replica = self.registry.replicas.get(replica_id) if isinstance(replica_id, str) else None
        if replica is None:
            self._from_unknown(identity, message)
            return
        if replica.identity != identity:
            self.forged.refuse(f"a {message.TYPE} in the name of replica {replica.replica_id!r} from another connection")
            return
        if isinstance(message, Heartbeat):
            self.registry.heartbeat(replica, message)
            if replica.draining and not self.dispatcher.holds(replica.replica_id):
                self.send(replica, Drained(replica.replica_id))
            self.dispatcher.drain_queue(replica.stage)
        elif isinstance(message, Output | Error):
            if isinstance(message, Output) and self.reconciler.repeated(replica, message):
                return  # sent again after a dropped connection, and we had it
            if not self._sent_to(replica, message.rid, message.stage):
                return
            if isinstance(message, Output):
                if self.reconciler.in_sequence(replica, message):
                    self.dispatcher.on_output(replica, message, frame)
            else:
                self.dispatcher.on_error(replica, message)
        elif isinstance(message, Resync):
            self.reconciler.ask(replica)
        elif isinstance(message, Holding):
            self.reconciler.settle(replica, message)
            self.dispatcher.drain_queue(replica.stage)
        else:
            self.registry.remove(replica.replica_id)
            self.dispatcher.replica_lost(replica, "left")
            log.info("replica %s of stage %s deregistered", replica.replica_id, replica.stage)

    def _sent_to(self, replica: Replica, rid: str, stage: str) -> bool:
        """Whether `replica` is the one request `rid` was sent to at `stage`. If not, the replica is
        told to let go of whatever it holds for that request (it ended, or moved to another replica)."""
        state = self.dispatcher.requests.get(rid)
        if state is not None and stage == replica.stage and state.at.get(stage) == replica.replica_id:
            return True
        if state is not None and rid not in replica.inflight:
            self.forged.refuse(f"an output for request {rid} from replica {replica.replica_id!r}, which was not sent it")
        self.send(replica, Abort(rid, "request already ended or moved to another replica"))
        return False

    def _from_unknown(self, identity: bytes, message: Message) -> None:
        """A message from a replica we do not know (we restarted, or took it out for silence)."""
        if self.registry.owner(identity) is not None:  # a registered connection naming another id
            self.forged.refuse(f"a {message.TYPE} naming an unknown replica from a registered connection")
            return
        if isinstance(message, Heartbeat):  # ask it to register again
            self._reply(identity, Rejected(message.replica, "unknown replica", reregister=True))
        elif isinstance(message, Output | Error):  # let it release what it put for that request
            self._reply(identity, Abort(message.rid, "unknown replica: register again"))

    def _register(self, identity: bytes, message: Register) -> None:
        try:
            replica, previous = self.registry.register(message, identity)
        except RegistrationRefused as exc:
            if exc.retry:
                self.forged.refuse(f"register of replica {message.replica!r}: {exc}")
            else:
                log.error("rejected replica %s: %s", message.replica, exc)
            self._reply(identity, Rejected(message.replica, str(exc), reregister=exc.retry))
            return
        self._reply(identity, Registered(replica.replica_id, HEARTBEAT_S))
        if previous is replica:
            return  # the same connection registering again: confirmed, nothing changes
        if previous is not None:
            self.dispatcher.replica_lost(previous, f"restarted (pid {previous.pid} -> {replica.pid})")
            self.registry.reclaim(previous)
        restart = f" (restart #{replica.restarts})" if replica.restarts else ""
        log.info("replica %s of stage %s registered from %s pid %d%s", replica.replica_id, replica.stage, replica.host, replica.pid, restart)
        self.dispatcher.drain_queue(replica.stage)

    async def _monitor_loop(self) -> None:
        loop = asyncio.get_running_loop()
        next_reap_check = loop.time()
        while True:
            await asyncio.sleep(MONITOR_S)
            self.registry.tick()  # a long gap since the last tick is our own stall, nobody's silence
            try:
                self.dispatcher.expire()
                for replica in self.registry.dead():
                    self._bury(replica)
                if loop.time() >= next_reap_check:
                    next_reap_check = loop.time() + REAP_CHECK_S
                    reaped = self.registry.reclaim_silent()
                    if reaped:
                        log.warning("reclaimed %d connector resource(s) of silent replicas now gone: %s", len(reaped), reaped)
            except Exception:
                self._monitor_errors.exception("monitor loop error")

    def _bury(self, replica: Replica) -> None:
        self.registry.remove(replica.replica_id)
        gone = replica.local_process_gone()
        reason = f"died (pid {replica.pid})" if gone else "stopped sending heartbeats"
        self.dispatcher.replica_lost(replica, reason)
        reaped = self.registry.reclaim(replica)
        log.warning(
            "replica %s of stage %s %s; removed%s",
            replica.replica_id, replica.stage, reason,
            f", reclaimed {len(reaped)} connector resource(s)" if reaped
            else "" if gone else "; its memory stays until its process is gone",
        )
