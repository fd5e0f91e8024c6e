"""The roles a mesh's containers play, as both exporters describe them: each role's command, its
environment and the check that says it is healthy. Compose and Kubernetes differ only in how they
wire these together (service names, ports, probes), so the two never drift apart.
"""

from __future__ import annotations

from dataclasses import dataclass

from omni_mesh.topology import Topology

KEYS_MOUNT = "/run/secrets/mesh_keys"  # where the mesh keys secret is mounted (compose's default path)
HEALTH_FILE = "/tmp/omni-mesh-healthy"
HTTP_PORT = 8000
CONTROL_PORT = 5555
#: A stage is healthy while its health file is younger than this; it is touched at every heartbeat
#: (0.5 s) and stops being touched when the replica loses the coordinator or starts draining.
HEALTH_FILE_MAX_AGE_S = 5
#: A draining replica gets 30 s to finish its work and hand over its outputs; then it is killed.
STAGE_STOP_GRACE_S = 45
#: The coordinator gives in-flight requests 10 s (--grace-s) when it stops.
COORDINATOR_STOP_GRACE_S = 15

COORDINATOR_HEALTH = [
    "python",
    "-c",
    "import os, urllib.request; "
    'urllib.request.urlopen("http://127.0.0.1:" + os.environ["OMNI_MESH_PORT"] + "/health", timeout=2)',
]
STAGE_HEALTH = [
    "python",
    "-c",
    "import os, sys, time; "
    f'sys.exit(time.time() - os.path.getmtime(os.environ["OMNI_MESH_HEALTH_FILE"]) > {HEALTH_FILE_MAX_AGE_S})',
]


def coordinator_env(topology_path: str, *, host: str, port: int, control_bind: str) -> dict[str, str]:
    return {
        "OMNI_MESH_TOPOLOGY": topology_path,
        "OMNI_MESH_KEYS_DIR": KEYS_MOUNT,
        "OMNI_MESH_PORT": str(port),
        "OMNI_MESH_HOST": host,
        "OMNI_MESH_CONTROL_BIND": control_bind,
    }


def stage_env(topology_path: str, stage: str, *, coordinator: str) -> dict[str, str]:
    # No OMNI_MESH_REPLICA: each replica names itself (stage-host-pid), so scaled replicas never clash.
    return {
        "OMNI_MESH_TOPOLOGY": topology_path,
        "OMNI_MESH_KEYS_DIR": KEYS_MOUNT,
        "OMNI_MESH_STAGE": stage,
        "OMNI_MESH_COORDINATOR": coordinator,
        "OMNI_MESH_HEALTH_FILE": HEALTH_FILE,
    }


@dataclass(frozen=True)
class StoreMaster:
    """A `mooncake_master` a MooncakeStoreConnector names by service (`master: NAME:PORT`)."""

    name: str
    port: int
    users: tuple[str, ...]  # the stages whose edges use the store

    def command(self, bind: str) -> list[str]:
        return ["mooncake_master", f"--rpc_address={bind}", f"--rpc_port={self.port}", "--metrics_port=9003"]

    def health(self) -> list[str]:
        return [
            "python",
            "-c",
            f'import socket; socket.create_connection(("127.0.0.1", {self.port}), timeout=2).close()',
        ]


def store_masters(topology: Topology) -> list[StoreMaster]:
    """The masters the topology's store connectors name by a service name (not an address): the export
    runs those as services of the mesh, from the same image."""
    found: dict[tuple[str, int], set[str]] = {}
    for edge in topology.edges:
        if edge.connector.name not in ("MooncakeStoreConnector", "MooncakeConnector"):
            continue
        host, _, port = str(edge.connector.extra.get("master", "")).rpartition(":")
        if not host or not port.isdigit() or _is_address(host):
            continue
        users = found.setdefault((host, int(port)), set())
        users.update({topology.stage(edge.src).name, topology.stage(edge.dst).name})
    return [
        StoreMaster(name, port, tuple(s.name for s in topology.stages if s.name in users))
        for (name, port), users in found.items()
    ]


def _is_address(host: str) -> bool:
    return host == "localhost" or host.replace(".", "").isdigit() or ":" in host
