"""Several coordinators in a Compose file (`omni-mesh export compose --coordinators N`, N > 1): no single
point of failure (docs/architecture.md, "Several coordinators"), the way `up --coordinators N` runs them.

- services `coordinator` (c0) and `coordinator-1` .. `coordinator-(N-1)`, all binding the one REST port
  with SO_REUSEPORT (`--reuse-port`: the kernel spreads connections over them), each with a REST port of
  its own (`--own-port`, its health check) and a control port of its own;
- one network namespace: on the bridge network the others join c0's (`network_mode:
  "service:coordinator"`), so the port c0 publishes reaches them all; on the host network they share the
  host's (loopback only);
- a named volume for their status directory (OMNI_MESH_COORDINATORS_DIR), so GET /v1/coordinators on any
  of them lists them all;
- every stage is given every control endpoint, comma-separated, and waits for every coordinator.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from omni_mesh.defaults import COORDINATOR_ID_ENV, COORDINATORS_DIR_ENV
from omni_mesh.export.source import ExportError

FIRST = "coordinator"
VOLUME = "coordinators"
#: Made in the image, owned by its user: an empty named volume takes that owner when first mounted.
STATUS_DIR = "/var/lib/omni-mesh/coordinators"


def name(index: int) -> str:
    """Coordinator `index`'s service: c0 keeps the single coordinator's name."""
    return FIRST if index == 0 else f"{FIRST}-{index}"


def own_health(port: int) -> list[str]:
    """Coordinator's health on its own REST port (the shared one may answer from another coordinator)."""
    return ["python", "-c", f'import urllib.request; urllib.request.urlopen("http://127.0.0.1:{port}/health", timeout=2)']


@dataclass(frozen=True)
class CoordinatorPorts:
    """Where N coordinators in one network namespace listen: the shared REST port, then by index each
    one's control port (control, control+1, ...) and own REST port (rest+1, rest+2, ...)."""

    rest: int
    controls: tuple[int, ...]
    owns: tuple[int, ...]

    @classmethod
    def make(cls, count: int, rest: int, control: int) -> CoordinatorPorts:
        if count < 1:
            raise ExportError(f"--coordinators must be at least 1, got {count}")
        ports = cls(rest, tuple(control + i for i in range(count)), tuple(rest + 1 + i for i in range(count)))
        taken = [rest, *ports.controls, *ports.owns]
        if len(set(taken)) < len(taken) or max(taken) > 65535:
            raise ExportError(
                f"--coordinators {count}: REST takes ports {rest}-{rest + count} (shared, then each coordinator's "
                f"own) and the control plane {control}-{control + count - 1}: they overlap or pass 65535; "
                "give the REST and control ports room apart"
            )
        return ports


def services(
    first: dict[str, Any],
    ports: CoordinatorPorts,
    *,
    host: bool,
    healthcheck: Callable[[list[str]], dict[str, Any]],
) -> dict[str, dict[str, Any]]:
    """The N coordinator services, made from the single coordinator's service `first`."""
    bind = first["environment"]["OMNI_MESH_CONTROL_BIND"].rpartition(":")[0]
    made: dict[str, dict[str, Any]] = {}
    for index, (control, own) in enumerate(zip(ports.controls, ports.owns, strict=True)):
        service = {key: value for key, value in first.items() if key not in ("stop_grace_period", "healthcheck")}
        service["command"] = [*first["command"], "--reuse-port", "--own-port", str(own)]
        service["environment"] = {
            **first["environment"],
            "OMNI_MESH_CONTROL_BIND": f"{bind}:{control}",
            COORDINATOR_ID_ENV: f"c{index}",
            COORDINATORS_DIR_ENV: STATUS_DIR,
        }
        if index > 0:
            service.pop("ports", None)  # c0 publishes the shared port for all of them
            service.pop("shm_size", None)
            if not host:
                service["network_mode"] = f"service:{FIRST}"
            if "ipc" in first:
                service["ipc"] = f"service:{FIRST}"
            service["depends_on"] = {FIRST: {"condition": "service_started"}}  # its network namespace
        service["volumes"] = [f"{VOLUME}:{STATUS_DIR}"]
        service["stop_grace_period"] = first["stop_grace_period"]
        service["healthcheck"] = healthcheck(own_health(own))
        made[name(index)] = service
    return made


def note(count: int, host: bool) -> str:
    """What survives what, for the header."""
    shared = (
        "the host's network (loopback only)"
        if host
        else "coordinator's network namespace (network_mode: service:coordinator), so the port coordinator "
        "publishes reaches them all"
    )
    others = ", ".join(name(i) for i in range(1, count))
    text = (
        f"Coordinators: {count} (coordinator, {others}) share the REST port "
        f"(SO_REUSEPORT: the kernel spreads new connections over them) in {shared}; each has a control port "
        "and a REST port of its own (its health check), and every stage registers with each. They share the "
        "`coordinators` volume, so GET /v1/coordinators on any lists them all. A coordinator process that "
        "dies is survived: the others keep serving, compose restarts it (restart: unless-stopped); requests "
        "in flight on it fail with a connection error a client may retry. A stopped one (SIGSTOP) turns "
        "unhealthy but keeps its share of new connections: compose restarts no unhealthy container (`up` does)."
    )
    if not host:
        text += (
            " Unlike Kubernetes, one container owns the network: when coordinator's container restarts or is "
            f"removed, {others} lose their network with it until they are restarted too "
            f"(`docker compose restart {others.replace(',', '')}`)."
        )
    return text
