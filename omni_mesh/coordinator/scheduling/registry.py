"""The stage replicas the coordinator knows: registration, heartbeats, health and selection."""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import Any

from omni_mesh.connectors import ProcessFacts, colocated, connector_type, holds, reclaim
from omni_mesh.control import Heartbeat, Register
from omni_mesh.defaults import HEARTBEAT_TIMEOUT_S as HEARTBEAT_TIMEOUT_S
from omni_mesh.hostinfo import machine_id, namespace, process_gone
from omni_mesh.topology import Topology

#: How long a replica may stay silent before it leaves the rotation and its requests fail: ten of the
#: intervals the coordinator announces (service.HEARTBEAT_S), so a replica busy for a few is not lost.
#: The one default: `serve` uses it, and `omni-mesh coordinator --heartbeat-timeout-s` repeats it.
#: A replica connects under a random routing id of its own (stage.link.routing_id), which the control
#: socket hands over to a new connection that presents it: one shorter, or made by ZeroMQ (a counter,
#: starting with a zero byte), could be guessed and taken over, so it cannot register.
MIN_ROUTING_ID_BYTES = 16
#: The coordinator's monitor reads the clock every 50 ms (service.MONITOR_S): a longer gap between two
#: readings means its own loop stood still (SIGSTOP, a long GC, a frozen VM), when it could hear nobody.
STALL_S = 0.5


class RegistrationRefused(ValueError):
    """A register the coordinator refuses; `retry`: the replica may try again later (its id is held
    by a connection that has not been confirmed gone yet)."""

    def __init__(self, message: str, *, retry: bool = False) -> None:
        super().__init__(message)
        self.retry = retry


@dataclass
class Replica:
    replica_id: str
    stage: str
    identity: bytes  # ZeroMQ routing id of its DEALER socket
    pid: int
    start: int  # process start time (clock ticks since boot): pid + start survive pid reuse
    host: str
    machine: str
    pidns: str
    max_inflight: int
    edges: dict[str, str]
    registered_at: float = 0.0  # on the registry's clock (Registry.now), set by `register`
    last_seen: float = 0.0
    inflight: set[str] = field(default_factory=set)
    #: requests that ended (deadline, abort) while it worked on them, until its heartbeat says it let go
    stopping: set[str] = field(default_factory=set)
    processed: int = 0
    errors: int = 0
    malformed: int = 0
    draining: bool = False
    connectors: dict[str, Any] = field(default_factory=dict)
    counters: dict[str, int | float] = field(default_factory=dict)  # the handler's (stage/counters.py)
    restarts: int = 0
    cleanup: dict[str, Any] = field(default_factory=dict)  # lifecycle token per connector type (opaque)
    #: With several coordinators: what its heartbeat says it works on for the others (a hint), and
    #: whether it refused our work as full since we last heard from it (then it is not picked).
    foreign: int = 0
    full: bool = False

    def sick_connectors(self) -> list[str]:
        return [ref for ref, h in self.connectors.items() if isinstance(h, dict) and h.get("status") == "unhealthy"]

    @property
    def busy(self) -> int:
        """Its slots taken: the requests it works on, and ended ones whose compute it is still stopping."""
        return len(self.inflight) + len(self.stopping) + self.foreign

    def stop(self, rid: str) -> None:
        """Request `rid` ended: if this replica was working on it, it stays busy until it has let go."""
        if rid in self.inflight:
            self.inflight.discard(rid)
            self.stopping.add(rid)

    def health(self, now: float, timeout_s: float) -> str:
        if now - self.last_seen > timeout_s:
            return "unhealthy"
        if self.sick_connectors():
            return "unhealthy"
        return "draining" if self.draining else "healthy"

    def local_process_gone(self) -> bool:
        """True only when the replica ran on this machine, in our PID namespace, and its process is
        confirmed gone: silence alone (a frozen or partitioned process) never counts, nor does a /proc
        we cannot read (out of file descriptors: `process_gone`)."""
        if self.machine != machine_id() or self.pidns != namespace("pid") or self.start == 0:
            return False
        return process_gone(self.pid, self.start)

    def process(self) -> ProcessFacts:
        """Its process as it registered (checked against this host's kernel before anything is reclaimed)."""
        return ProcessFacts(self.pid, self.start, self.pidns, self.machine)

    def describe(self, now: float, timeout_s: float) -> dict[str, Any]:
        return {
            "id": self.replica_id,
            "host": self.host,
            "pid": self.pid,
            "health": self.health(now, timeout_s),
            "inflight": self.busy,
            "stopping": len(self.stopping),
            "max_inflight": self.max_inflight,
            "processed": self.processed,
            "errors": self.errors,
            "malformed_messages": self.malformed,
            "restarts": self.restarts,
            "last_heartbeat_s_ago": round(now - self.last_seen, 3),
            "uptime_s": round(now - self.registered_at, 3),
            "cleanup": self.cleanup,
            "connectors": self.connectors,
            "counters": self.counters,
        }


class Registry:
    def __init__(
        self, topology: Topology, heartbeat_timeout_s: float = HEARTBEAT_TIMEOUT_S, *, shared: bool = False
    ) -> None:
        self.topology = topology
        self.shared = shared  # one of several coordinators: replicas also work for the others
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.replicas: dict[str, Replica] = {}
        self.by_identity: dict[bytes, Replica] = {}
        self.silent: dict[str, Replica] = {}  # taken out for silence, process not confirmed gone
        self.restarts: dict[str, int] = {}
        self._last_pid: dict[str, int] = {}  # replica id -> pid of its latest registration
        # one round robin per stage: a shared count, advanced by the other stages' picks in between, sent
        # every encoder request of an alternating encoder -> thinker flow to the same replica
        self._tiebreak: dict[str, itertools.count] = {}
        self.stalled_s = 0.0  # how long our own loop stood still, in all: no replica's silence
        self._last_reading: float | None = None  # None until the monitor ticks (`tick`)
        self.expected_edges = {
            edge.label: edge.connector.name for edge in topology.edges
        }

    # ------------------------------------------------------------------ the clock silence is judged by

    def now(self) -> float:
        """The coordinator's own time: the monotonic clock less every stretch its loop stood still. A
        replica is silent only while we were there to hear it: after a pause of S seconds every
        replica's deadline is S later, whichever runs first on resume (the monitor, a REST call, or
        the queued heartbeats)."""
        reading = time.monotonic()
        if self._last_reading is not None:
            gap = reading - self._last_reading
            if gap > STALL_S:
                self.stalled_s += gap - STALL_S
            self._last_reading = reading
        return reading - self.stalled_s

    def tick(self) -> float:
        """The monitor's reading, every MONITOR_S: from the first one on, gaps count as stalls."""
        if self._last_reading is None:
            self._last_reading = time.monotonic()
        return self.now()

    # ------------------------------------------------------------------ membership

    def register(self, message: Register, identity: bytes) -> tuple[Replica, Replica | None]:
        """Admit a replica: (the replica, the one it replaces, or itself when the same connection
        registers again) or RegistrationRefused (sent back to it).

        A replica id belongs to the connection that registered it: the same connection registering
        again is confirmed, another connection may take the id over only once its holder is confirmed
        gone (its process died on this host) or has been taken out for silence.
        """
        stage = message.stage
        if len(identity) < MIN_ROUTING_ID_BYTES or identity[0] == 0:
            raise RegistrationRefused(
                f"replica {message.replica!r} of stage {stage!r} connected without a random routing id of "
                f"at least {MIN_ROUTING_ID_BYTES} bytes (ZMQ_ROUTING_ID): another connection could take its "
                "place; run the replica from this version of omni-mesh"
            )
        names = {s.name for s in self.topology.stages}
        if stage not in names:
            raise RegistrationRefused(
                f"stage {stage!r} is not in topology {self.topology.name!r} (stages: {', '.join(sorted(names))})"
            )
        for label, connector in message.edges.items():
            expected = self.expected_edges.get(label)
            if expected != connector:
                raise RegistrationRefused(
                    f"replica {message.replica!r} of stage {stage!r} wires edge {label} with {connector}, "
                    f"the coordinator's topology says {expected}: run every service from the same topology file"
                )
        replica_id = message.replica
        previous = self.replicas.get(replica_id)
        if previous is not None and previous.identity == identity:
            previous.last_seen = self.now()  # a repeated register (sent while we were starting)
            return previous, previous
        if previous is not None and not previous.local_process_gone():
            raise RegistrationRefused(
                f"replica id {replica_id!r} is held by a live connection (pid {previous.pid} on {previous.host}); "
                "give every replica its own id", retry=True,
            )
        last_pid = self._last_pid.get(replica_id)
        if last_pid is not None and last_pid != message.pid:  # not a replica back from silence
            self.restarts[replica_id] = self.restarts.get(replica_id, 0) + 1
        self._last_pid[replica_id] = message.pid
        self.silent.pop(replica_id, None)
        now = self.now()
        replica = Replica(
            replica_id=replica_id,
            registered_at=now,
            last_seen=now,
            stage=stage,
            identity=identity,
            pid=message.pid,
            start=message.start,
            host=message.host,
            machine=message.machine,
            pidns=message.pidns,
            max_inflight=max(1, message.max_inflight),
            edges=dict(message.edges),
            restarts=self.restarts.get(replica_id, 0),
            connectors=message.connectors,
            cleanup=dict(message.cleanup),
        )
        self.replicas[replica_id] = replica
        self.by_identity[identity] = replica
        if previous is not None:
            self.by_identity.pop(previous.identity, None)
        return replica, previous

    def heartbeat(self, replica: Replica, message: Heartbeat) -> None:
        replica.last_seen = self.now()
        replica.processed = message.processed
        replica.errors = message.errors
        replica.malformed = message.malformed
        replica.draining = message.draining
        replica.connectors = message.connectors
        working = {rid for rid in message.working if isinstance(rid, str)}
        replica.stopping &= working
        replica.full = False  # it told us how it is: a slot may be free again
        if self.shared:
            replica.foreign = len(working - replica.inflight - replica.stopping)
        replica.counters = message.counters

    def remove(self, replica_id: str) -> Replica | None:
        replica = self.replicas.pop(replica_id, None)
        if replica is not None:
            self.by_identity.pop(replica.identity, None)
        return replica

    def owner(self, identity: bytes) -> Replica | None:
        """The replica registered by the connection `identity`, if any."""
        return self.by_identity.get(identity)

    def dead(self) -> list[Replica]:
        """Replicas whose heartbeats stopped or whose local process is gone."""
        now = self.now()
        return [
            r
            for r in self.replicas.values()
            if now - r.last_seen > self.heartbeat_timeout_s or r.local_process_gone()
        ]

    def reclaim(self, replica: Replica) -> list[str]:
        """Have its connector types reclaim what a replica held once its process is confirmed dead on
        this host (what: the types' business; for whose process: derived from what we verified, never
        from the tokens alone). A silent replica keeps what it holds: it is watched (`reclaim_silent`)
        until its process is gone, or it comes back and registers again."""
        if not holds(replica.cleanup, replica.process()):
            return []
        if not replica.local_process_gone():
            self.silent[replica.replica_id] = replica
            return []
        self.silent.pop(replica.replica_id, None)
        return reclaim(replica.cleanup, replica.process())

    def reclaim_silent(self) -> list[str]:
        """Reclaim what silent replicas whose process has since died held."""
        return [
            name for replica in list(self.silent.values()) if replica.local_process_gone()
            for name in self.reclaim(replica)
        ]

    # ------------------------------------------------------------------ selection

    def of_stage(self, stage: str) -> list[Replica]:
        return [r for r in self.replicas.values() if r.stage == stage]

    def pick(self, stage: str) -> Replica | None:
        """The least-loaded healthy replica of `stage` with a free slot (ties: round robin)."""
        now = self.now()
        candidates = [
            r
            for r in self.of_stage(stage)
            if r.health(now, self.heartbeat_timeout_s) == "healthy" and r.busy < r.max_inflight and not r.full
        ]
        if not candidates:
            return None
        least = min(r.busy for r in candidates)
        tied = [r for r in candidates if r.busy == least]
        turns = self._tiebreak.setdefault(stage, itertools.count())
        return tied[next(turns) % len(tied)]

    def is_healthy(self, replica: Replica) -> bool:
        return replica.health(self.now(), self.heartbeat_timeout_s) == "healthy"

    def has_healthy(self, stage: str) -> bool:
        return any(self.is_healthy(r) for r in self.of_stage(stage))

    # ------------------------------------------------------------------ readiness

    def readiness(self, scaled_to_zero: set[str] | None = None) -> list[str]:
        """What keeps the mesh from being ready; empty when every stage and edge can work. A stage
        scaled to zero (autoscale:) is idle, not missing: a request starts a replica of it."""
        problems, scaled_to_zero = [], scaled_to_zero or set()
        for stage in self.topology.stages:
            if stage.name not in scaled_to_zero and not self.has_healthy(stage.name):
                count = len(self.of_stage(stage.name))
                problems.append(
                    f"stage {stage.name!r} ({stage.stage_id}) has no healthy replica ({count} registered)"
                )
        for edge in self.topology.edges:
            ends = {self.topology.stage(edge.src).name, self.topology.stage(edge.dst).name}
            if not ends & scaled_to_zero:
                problems.extend(self._edge_problems(edge))
        return problems

    def _edge_problems(self, edge) -> list[str]:
        src = self.topology.stage(edge.src).name
        dst = self.topology.stage(edge.dst).name
        now = self.now()
        senders = [r for r in self.of_stage(src) if r.health(now, self.heartbeat_timeout_s) == "healthy"]
        receivers = [r for r in self.of_stage(dst) if r.health(now, self.heartbeat_timeout_s) == "healthy"]
        name = edge.connector.name
        if not senders or not receivers:
            side = "sender" if not senders else "receiver"
            return [f"edge {edge.label} ({src}->{dst}, {name}) has no live {side}"]
        if connector_type(name).scope != "host":
            return []
        apart = [(s, r) for s in senders for r in receivers if not colocated(name, s.cleanup, r.cleanup)]
        if not apart:
            return []
        s, r = apart[0]
        return [
            f"edge {edge.label} ({src}->{dst}) uses {name}, which only works inside one host, but replica "
            f"{s.replica_id!r} on {s.host} and replica {r.replica_id!r} on {r.host} do not share shared memory: "
            f"use MooncakeTransferEngineConnector or ZmqConnector for this edge"
        ]
