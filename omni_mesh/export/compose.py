"""A topology as a Compose file: `omni-mesh export compose TOPOLOGY`.

One service per role, all from the one image: the coordinator, one service per stage (`--scale
STAGE=N` adds and removes replicas: no published port, no container_name, no fixed replica id), and a
`mooncake_master` for each store the topology names by service. Every service mounts the `mesh_keys`
secret and has a health check; stages start once the coordinator (and their store) is healthy.

Two networks:
- `bridge` (the default, the committed files): services reach each other by service name; only the
  coordinator's REST port is published, on 127.0.0.1 unless OMNI_MESH_HTTP_BIND says otherwise.
- `host`: every service on the host's network, listening on 127.0.0.1 only, each on its own port (the
  test suite runs the demo this way: loopback only). The build uses the host's network too.
"""

from __future__ import annotations

import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omni_mesh.export import compose_coordinators as several
from omni_mesh.export.output import Exported, render
from omni_mesh.export.placement import crossing_warnings, shm_edges
from omni_mesh.export.resources import stage_resources
from omni_mesh.export.roles import (
    CONTROL_PORT,
    COORDINATOR_HEALTH,
    COORDINATOR_STOP_GRACE_S,
    HTTP_PORT,
    STAGE_HEALTH,
    STAGE_STOP_GRACE_S,
    StoreMaster,
    coordinator_env,
    stage_env,
    store_masters,
)
from omni_mesh.export.source import DOCKERFILE, ExportError, ImageSource
from omni_mesh.topology import StageSpec, Topology

COORDINATOR = "coordinator"
NETWORKS = ("bridge", "host")
SECRET = "mesh_keys"
WIDTH = 104  # header comment lines


@dataclass(frozen=True)
class ComposeOptions:
    network: str = "bridge"
    http_port: int = HTTP_PORT  # host network: the REST port on 127.0.0.1
    control_port: int = CONTROL_PORT  # host network: the control plane's port on 127.0.0.1
    coordinators: int = 1  # more: compose_coordinators.py

    def __post_init__(self) -> None:
        if self.network not in NETWORKS:
            raise ExportError(f"network {self.network!r}: choose one of {', '.join(NETWORKS)}")
        if self.network == "host" and self.http_port == self.control_port:
            raise ExportError(f"the REST and control ports are both {self.http_port}: give each its own")
        self.ports()  # refuses ports that clash

    def ports(self) -> several.CoordinatorPorts:
        """Where the coordinators listen (the bridge network: the defaults, in coordinator's namespace)."""
        host = self.network == "host"
        rest, control = (self.http_port, self.control_port) if host else (HTTP_PORT, CONTROL_PORT)
        return several.CoordinatorPorts.make(self.coordinators, rest, control)


def export_compose(
    topology: Topology, source: ImageSource, output: Path | None, options: ComposeOptions | None = None
) -> Exported:
    """The compose file for `topology`, to be written at `output` (None: standard output, read from the
    current directory): compose resolves the build context and the secret's file from there."""
    options = options or ComposeOptions()
    directory = output.parent if output is not None else Path.cwd()
    builder = _Builder(topology, source, directory, options)
    warnings = crossing_warnings(topology) if options.network == "bridge" else []
    scaled = [stage.name for stage in topology.stages if stage.autoscale is not None]
    warnings += [autoscale_note(scaled)] if scaled else []
    text = render([builder.document()], _header(topology, source, output, options), builder.anchors)
    return Exported(text, warnings)


class _Builder:
    def __init__(self, topology: Topology, source: ImageSource, directory: Path, options: ComposeOptions) -> None:
        self.topology = topology
        self.source = source
        self.directory = directory
        self.host = options.network == "host"
        self.options = options
        self.masters = store_masters(topology)
        self.shares_memory = bool(shm_edges(topology))
        # Written once and aliased in every other service (`build: *build`).
        self.build = self._build()
        self.stage_health = _healthcheck(STAGE_HEALTH, start_period_s=60)
        self.anchors = {id(self.build): "build", id(self.stage_health): "stage-healthcheck"}
        taken = {stage.name for stage in topology.stages}
        coordinators = [several.name(i) for i in range(options.coordinators)]
        for name in [*coordinators, *(m.name for m in self.masters)]:
            if name in taken:
                raise ExportError(
                    f"stage {name!r}: the compose file needs a service of that name for the "
                    f"{'coordinator' if name in coordinators else 'Mooncake store master'}; rename the stage"
                )

    def document(self) -> dict[str, Any]:
        services: dict[str, Any] = {}
        for master in self.masters:
            services[master.name] = self.master(master)
        services[COORDINATOR] = self.coordinator()
        if self.options.coordinators > 1:
            services.update(several.services(services[COORDINATOR], self.options.ports(), host=self.host, healthcheck=_healthcheck_30s))
        for stage in self.topology.stages:
            services[stage.name] = self.stage(stage)
        document: dict[str, Any] = {"services": services}
        if self.options.coordinators > 1:
            document["volumes"] = {several.VOLUME: {}}
        document["secrets"] = {SECRET: {"file": "${OMNI_MESH_KEYS_FILE:-./keys/mesh.key_secret}"}}
        return document

    def _build(self) -> dict[str, Any]:
        build: dict[str, Any] = {"context": self.source.context_from(self.directory), "dockerfile": str(DOCKERFILE)}
        if self.host:
            build["network"] = "host"  # RUN steps reach the package indexes through the host
        build["args"] = {name: f"${{{name}:-{default}}}" for name, default in self.source.build_args().items()}
        return build

    def base(self) -> dict[str, Any]:
        base: dict[str, Any] = {
            "image": "${OMNI_MESH_IMAGE:-omni-mesh:latest}",
            "build": self.build,
            "init": True,
            "restart": "unless-stopped",
            "secrets": [SECRET],
        }
        if self.host:
            base["network_mode"] = "host"
        return base

    def coordinator(self) -> dict[str, Any]:
        port = self.options.http_port if self.host else HTTP_PORT
        control = self.options.control_port if self.host else CONTROL_PORT
        bind = "127.0.0.1" if self.host else "0.0.0.0"
        service = self.base()
        service["command"] = ["omni-mesh", "coordinator"]
        service["environment"] = coordinator_env(
            self.source.in_image, host=bind, port=port, control_bind=f"tcp://{bind}:{control}"
        )
        if not self.host:
            service["ports"] = [f"${{OMNI_MESH_HTTP_BIND:-127.0.0.1}}:${{OMNI_MESH_HTTP_PORT:-{port}}}:{port}"]
        if self.shares_memory:
            service["ipc"] = "shareable"  # every stage joins it: shared memory between containers
            service["shm_size"] = "${OMNI_MESH_SHM_SIZE:-2gb}"
        service["stop_grace_period"] = f"{COORDINATOR_STOP_GRACE_S}s"
        service["healthcheck"] = _healthcheck_30s(COORDINATOR_HEALTH)
        return service

    def stage(self, stage: StageSpec) -> dict[str, Any]:
        where = "127.0.0.1" if self.host else COORDINATOR  # several coordinators: all in one namespace
        endpoints = ",".join(f"tcp://{where}:{control}" for control in self.options.ports().controls)
        service = self.base()
        service["command"] = ["omni-mesh", "stage"]
        service["environment"] = stage_env(self.source.in_image, stage.name, coordinator=endpoints)
        if self.shares_memory:
            service["ipc"] = f"service:{COORDINATOR}"
        masters = [m for m in self.masters if stage.name in m.users]
        if self.host and masters:
            service["extra_hosts"] = [f"{m.name}:127.0.0.1" for m in masters]
        if stage.replicas > 1:
            service["scale"] = stage.replicas
        resources = stage_resources(stage)
        if resources.gpus:
            device = {"driver": resources.gpu_vendor, "count": resources.gpus, "capabilities": ["gpu"]}
            service["deploy"] = {"resources": {"reservations": {"devices": [device]}}}
        coordinators = [several.name(i) for i in range(self.options.coordinators)]
        service["depends_on"] = {
            name: {"condition": "service_healthy"} for name in [*coordinators, *(m.name for m in masters)]
        }
        service["stop_grace_period"] = f"{STAGE_STOP_GRACE_S}s"
        service["healthcheck"] = self.stage_health
        return service

    def master(self, master: StoreMaster) -> dict[str, Any]:
        service = self.base()
        service["command"] = master.command("127.0.0.1" if self.host else "0.0.0.0")
        service["healthcheck"] = _healthcheck(master.health(), start_period_s=10)
        return service


def _healthcheck(command: list[str], *, start_period_s: int) -> dict[str, Any]:
    return {"test": ["CMD", *command], "interval": "5s", "timeout": "3s", "retries": 3, "start_period": f"{start_period_s}s"}


def _healthcheck_30s(command: list[str]) -> dict[str, Any]:
    """A coordinator's health check."""
    return _healthcheck(command, start_period_s=30)


def _header(topology: Topology, source: ImageSource, output: Path | None, options: ComposeOptions) -> list[str]:
    file = source.shown(output) if output is not None else "docker-compose.yml"
    flags = "" if options.network == "bridge" else (
        f" --network host --http-port {options.http_port} --control-port {options.control_port}"
    )
    flags += f" --coordinators {options.coordinators}" if options.coordinators > 1 else ""
    chain = " -> ".join(stage.name for stage in topology.stages)
    scaled = topology.stages[min(1, len(topology.stages) - 1)].name
    paragraphs = [
        f"Generated from {source.relative}: edit the topology and export again rather than this file "
        "(tests/test_export.py checks that they agree):",
        f"  omni-mesh export compose {source.relative}{flags} -o {file}",
        "",
        f"{topology.name}: {_coordinators(options.coordinators)} and one service per stage ({chain}), all from the image built "
        f"from {DOCKERFILE}.",
        "",
    ]
    commands = [
        f"  docker compose -f {file} up --build -d",
        f"  docker compose -f {file} up -d --scale {scaled}=3   # more replicas of a stage",
        f"  docker compose -f {file} down",
    ]
    notes = [
        "Scaling: stage services publish no ports and set no container_name, so `--scale STAGE=N` adds and "
        "removes replicas of a running mesh. Each replica finds the coordinator, registers and heartbeats; "
        "stopped (SIGTERM), it finishes its work and deregisters before it exits (stop_grace_period)."
    ]
    if options.coordinators > 1:
        notes.append(several.note(options.coordinators, options.network == "host"))
    scaled_stages = [stage.name for stage in topology.stages if stage.autoscale is not None]
    if scaled_stages:
        notes.append(autoscale_note(scaled_stages))
    if shm_edges(topology):
        notes.append(
            "Shared memory: the coordinator owns an IPC namespace (`ipc: shareable`, sized by `shm_size`) and "
            "every stage joins it, so SharedMemoryConnector works between containers; no other mesh sees its "
            "segments. Each producing replica maps a pool in it (4 MiB at start, grown as payloads need): raise "
            "OMNI_MESH_SHM_SIZE when you scale producers far."
        )
    notes += [f"{m.name}: the Mooncake store's master, named by this service in the topology." for m in store_masters(topology)]
    variables = [
        "OMNI_MESH_KEYS_FILE (the mesh keys, default ./keys/mesh.key_secret next to this file, made with "
        "`omni-mesh keys generate DIR`; mounted as it is, so it must be readable by the image's uid 10001)",
        f"the build arguments of {DOCKERFILE} ({', '.join(source.build_args())})",
    ]
    if options.network == "host":
        notes.append(
            f"Network: every service on the host's network, listening on 127.0.0.1 only: REST on "
            f"{options.http_port}, the control plane on {options.control_port}{_more_ports(options)}."
        )
    else:
        variables[:0] = [
            "OMNI_MESH_HTTP_BIND and OMNI_MESH_HTTP_PORT (where REST is published, default 127.0.0.1:8000)",
            "OMNI_MESH_IMAGE (default omni-mesh:latest)",
            *(["OMNI_MESH_SHM_SIZE (default 2gb)"] if shm_edges(topology) else []),
        ]
    notes.append("Variables: " + ", ".join(variables) + ".")
    lines = [line for paragraph in paragraphs for line in (_wrap(paragraph) or [""])]
    lines += [*commands, ""]
    for note in notes:
        lines += [*_wrap(note), ""]
    return lines[:-1]


def _more_ports(options: ComposeOptions) -> str:
    """Several coordinators: the ports past the first each takes."""
    if options.coordinators == 1:
        return ""
    ports = options.ports()
    return (
        f" (each coordinator's own: control {ports.controls[0]}-{ports.controls[-1]}, "
        f"REST {ports.owns[0]}-{ports.owns[-1]})"
    )


def _coordinators(count: int) -> str:
    return "the coordinator" if count == 1 else f"{count} coordinators"


def autoscale_note(stages: list[str]) -> str:
    """Why compose ignores `autoscale:`, and what to do instead (the header says it, and so does stderr)."""
    return (
        f"Autoscaling: compose cannot start containers by itself, so the autoscale: section of {', '.join(stages)} "
        "is ignored here (each starts with its replicas:); scale by hand with `--scale STAGE=N`, or run the "
        "topology with `omni-mesh up` (which acts on it) or on Kubernetes (`omni-mesh export k8s` makes HPAs)."
    )


def _wrap(text: str) -> list[str]:
    return textwrap.wrap(text, WIDTH, break_on_hyphens=False, break_long_words=False)
