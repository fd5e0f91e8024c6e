"""Which stages must share memory, and which edges cross from one container to another.

A SharedMemoryConnector edge works only between processes that see the same /dev/shm: compose gives
every stage the coordinator's IPC namespace, Kubernetes puts the stages such edges join into one pod.
Every other edge crosses containers, so its connector must advertise an address the other side can
reach (not loopback), and some need a service the export does not run.
"""

from __future__ import annotations

from omni_mesh.topology import EdgeSpec, StageSpec, Topology

SHM = "SharedMemoryConnector"
#: Connectors whose `host` is the address they bind and advertise to the consuming side.
_ADVERTISING = {
    "ZmqConnector",
    "MooncakeTransferEngineConnector",
    "MooncakeStoreConnector",
    "MooncakeConnector",
    "MoriTransferEngineConnector",
    "YuanrongTransferEngineConnector",
}
_LOOPBACK = ("127.", "localhost", "::1")


def describe(topology: Topology, edge: EdgeSpec) -> str:
    """`1->2 (talker -> code2wav)`: how every message names an edge."""
    return f"{edge.label} ({topology.stage(edge.src).name} -> {topology.stage(edge.dst).name})"


def shm_edges(topology: Topology) -> list[EdgeSpec]:
    return [edge for edge in topology.edges if edge.connector.name == SHM]


def shm_groups(topology: Topology) -> list[list[StageSpec]]:
    """The stages joined by shared-memory edges, as groups (a stage with none is a group of its own),
    each in topological order, the groups ordered by their first stage."""
    group_of = {stage.stage_id: {stage.stage_id} for stage in topology.stages}
    for edge in shm_edges(topology):
        merged = group_of[edge.src] | group_of[edge.dst]
        for sid in merged:
            group_of[sid] = merged
    seen: list[set[int]] = []
    for stage in topology.stages:
        if not any(group_of[stage.stage_id] is group for group in seen):
            seen.append(group_of[stage.stage_id])
    return [[stage for stage in topology.stages if stage.stage_id in group] for group in seen]


def crossing_warnings(topology: Topology) -> list[str]:
    """What will not work once the edges that are not shared memory cross containers."""
    warnings = []
    for edge in topology.edges:
        name, extra = edge.connector.name, edge.connector.extra
        host = str(extra.get("host", "auto"))
        if name in _ADVERTISING and host.startswith(_LOOPBACK):
            warnings.append(
                f"edge {describe(topology, edge)}: {name} advertises host {host}, which another container "
                "cannot reach; set host: auto (or an address the consumer reaches)"
            )
        elif name == "YuanrongConnector":
            warnings.append(
                f"edge {describe(topology, edge)}: YuanrongConnector needs an openYuanrong datasystem worker "
                f"at {host}:{extra.get('port', 31501)} in reach of both stages; the export does not run one"
            )
    return warnings
