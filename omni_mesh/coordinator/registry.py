"""The stage replicas the coordinator knows: registration, heartbeats, health and selection."""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import Any

from omni_mesh.connectors import connector_class
from omni_mesh.connectors.shm_segments import list_segments, process_start_time, unlink_segment
from omni_mesh.hostinfo import machine_id, namespace, shm_domain
from omni_mesh.topology import Topology


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
    shm_domain: str
    shm_prefix: str
    max_inflight: int
    edges: dict[str, str]
    registered_at: float = field(default_factory=time.monotonic)
    last_seen: float = field(default_factory=time.monotonic)
    inflight: set[str] = field(default_factory=set)
    processed: int = 0
    errors: int = 0
    malformed: int = 0
    draining: bool = False
    connectors: dict[str, Any] = field(default_factory=dict)
    restarts: int = 0

    def sick_connectors(self) -> list[str]:
        return [ref for ref, h in self.connectors.items() if isinstance(h, dict) and h.get("status") == "unhealthy"]

    def health(self, now: float, timeout_s: float) -> str:
        if now - self.last_seen > timeout_s:
            return "unhealthy"
        if self.sick_connectors():
            return "unhealthy"
        return "draining" if self.draining else "healthy"

    def local_process_gone(self) -> bool:
        """True when the replica ran on this machine, in our PID namespace, and its process is gone."""
        if self.machine != machine_id() or self.pidns != namespace("pid"):
            return False
        started = process_start_time(self.pid)
        return started is None or (self.start != 0 and started != self.start)

    def describe(self, now: float, timeout_s: float) -> dict[str, Any]:
        return {
            "id": self.replica_id,
            "host": self.host,
            "pid": self.pid,
            "health": self.health(now, timeout_s),
            "inflight": len(self.inflight),
            "max_inflight": self.max_inflight,
            "processed": self.processed,
            "errors": self.errors,
            "malformed_messages": self.malformed,
            "restarts": self.restarts,
            "last_heartbeat_s_ago": round(now - self.last_seen, 3),
            "uptime_s": round(now - self.registered_at, 3),
            "shm_domain": self.shm_domain,
            "connectors": self.connectors,
        }


class Registry:
    def __init__(self, topology: Topology, heartbeat_timeout_s: float = 2.5) -> None:
        self.topology = topology
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.replicas: dict[str, Replica] = {}
        self.restarts: dict[str, int] = {}
        self._seen_ids: set[str] = set()
        self._tiebreak = itertools.count()
        self.expected_edges = {
            edge.label: edge.connector.name for edge in topology.edges
        }

    # ------------------------------------------------------------------ membership

    def register(self, message: dict[str, Any], identity: bytes) -> Replica:
        """Admit a replica; raises ValueError (sent back to it) when it does not fit the topology."""
        stage = message["stage"]
        names = {s.name for s in self.topology.stages}
        if stage not in names:
            raise ValueError(f"stage {stage!r} is not in topology {self.topology.name!r} (stages: {', '.join(sorted(names))})")
        for label, connector in message["edges"].items():
            expected = self.expected_edges.get(label)
            if expected != connector:
                raise ValueError(
                    f"replica {message['replica']!r} of stage {stage!r} wires edge {label} with {connector}, "
                    f"the coordinator's topology says {expected}: run every service from the same topology file"
                )
        replica_id = message["replica"]
        previous = self.replicas.get(replica_id)
        if previous is not None and previous.pid == message["pid"] and previous.identity == identity:
            previous.last_seen = time.monotonic()  # a repeated register (sent while we were starting)
            return previous
        if replica_id in self._seen_ids and (previous is None or previous.pid != message["pid"]):
            self.restarts[replica_id] = self.restarts.get(replica_id, 0) + 1
        self._seen_ids.add(replica_id)
        replica = Replica(
            replica_id=replica_id,
            stage=stage,
            identity=identity,
            pid=message["pid"],
            start=int(message.get("start") or 0),
            host=message["host"],
            machine=str(message.get("machine", "")),
            pidns=str(message.get("pidns", "")),
            shm_domain=str(message.get("shm_domain", "")),
            shm_prefix=str(message.get("shm_prefix", "")),
            max_inflight=max(1, message["max_inflight"]),
            edges=dict(message["edges"]),
            restarts=self.restarts.get(replica_id, 0),
        )
        connectors = message.get("connectors")
        if isinstance(connectors, dict):
            replica.connectors = connectors
        if previous is not None:
            replica.inflight = previous.inflight  # the caller fails these: that process is gone
        self.replicas[replica_id] = replica
        return replica

    def heartbeat(self, message: dict[str, Any]) -> Replica | None:
        replica = self.replicas.get(message["replica"])
        if replica is None:
            return None
        replica.last_seen = time.monotonic()
        for name in ("processed", "errors", "malformed"):
            value = message.get(name)
            if isinstance(value, int):
                setattr(replica, name, value)
        replica.draining = bool(message.get("draining", False))
        connectors = message.get("connectors")
        if isinstance(connectors, dict):
            replica.connectors = connectors
        return replica

    def remove(self, replica_id: str) -> Replica | None:
        return self.replicas.pop(replica_id, None)

    def dead(self) -> list[Replica]:
        """Replicas whose heartbeats stopped or whose local process is gone."""
        now = time.monotonic()
        return [
            r
            for r in self.replicas.values()
            if now - r.last_seen > self.heartbeat_timeout_s or r.local_process_gone()
        ]

    def reap_segments(self, replica: Replica) -> list[str]:
        """Unlink a dead replica's shared-memory segments, if we share its /dev/shm."""
        if not replica.shm_prefix or replica.shm_domain != shm_domain():
            return []
        return [name for name in list_segments() if name.startswith(replica.shm_prefix) and unlink_segment(name)]

    # ------------------------------------------------------------------ selection

    def of_stage(self, stage: str) -> list[Replica]:
        return [r for r in self.replicas.values() if r.stage == stage]

    def pick(self, stage: str) -> Replica | None:
        """The least-loaded healthy replica of `stage` with a free slot (ties: round robin)."""
        now = time.monotonic()
        candidates = [
            r
            for r in self.of_stage(stage)
            if r.health(now, self.heartbeat_timeout_s) == "healthy" and len(r.inflight) < r.max_inflight
        ]
        if not candidates:
            return None
        least = min(len(r.inflight) for r in candidates)
        tied = [r for r in candidates if len(r.inflight) == least]
        return tied[next(self._tiebreak) % len(tied)]

    def is_healthy(self, replica: Replica) -> bool:
        return replica.health(time.monotonic(), self.heartbeat_timeout_s) == "healthy"

    def has_healthy(self, stage: str) -> bool:
        return any(self.is_healthy(r) for r in self.of_stage(stage))

    # ------------------------------------------------------------------ readiness

    def readiness(self) -> list[str]:
        """What keeps the mesh from being ready; empty when every stage and edge can work."""
        problems = []
        for stage in self.topology.stages:
            if not self.has_healthy(stage.name):
                count = len(self.of_stage(stage.name))
                problems.append(
                    f"stage {stage.name!r} ({stage.stage_id}) has no healthy replica ({count} registered)"
                )
        for edge in self.topology.edges:
            problems.extend(self._edge_problems(edge))
        return problems

    def _edge_problems(self, edge) -> list[str]:
        src = self.topology.stage(edge.src).name
        dst = self.topology.stage(edge.dst).name
        now = time.monotonic()
        senders = [r for r in self.of_stage(src) if r.health(now, self.heartbeat_timeout_s) == "healthy"]
        receivers = [r for r in self.of_stage(dst) if r.health(now, self.heartbeat_timeout_s) == "healthy"]
        name = edge.connector.name
        if not senders or not receivers:
            side = "sender" if not senders else "receiver"
            return [f"edge {edge.label} ({src}->{dst}, {name}) has no live {side}"]
        if connector_class(name).scope != "host":
            return []
        apart = [(s, r) for s in senders for r in receivers if s.shm_domain != r.shm_domain]
        if not apart:
            return []
        s, r = apart[0]
        return [
            f"edge {edge.label} ({src}->{dst}) uses {name}, which only works inside one host, but replica "
            f"{s.replica_id!r} on {s.host} and replica {r.replica_id!r} on {r.host} do not share shared memory: "
            f"use MooncakeTransferEngineConnector or ZmqConnector for this edge"
        ]
