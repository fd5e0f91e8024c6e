"""Several coordinators on Kubernetes (`omni-mesh export k8s --coordinators N`, N > 1): no single point of
failure (docs/architecture.md, "Several coordinators").

- a StatefulSet of N coordinator pods, each with a stable DNS name under a headless Service
  (`<mesh>-coordinator-<i>.<mesh>-coordinator-peers`): every stage replica is given all N control
  endpoints and keeps one link to each; the pods start and stop in parallel (none waits for another);
- the REST Service `<mesh>-coordinator` over every ready pod (clients reach any of them);
- a PodDisruptionBudget: a drain or an upgrade takes at most one coordinator away at a time.
Each pod's name is its coordinator id (OMNI_MESH_COORDINATOR_ID): it prefixes the request ids it makes
and names it in X-Omni-Coordinator. Autoscaling stays the HPAs' (one decision for the mesh).
"""

from __future__ import annotations

from typing import Any

from omni_mesh.defaults import COORDINATOR_ID_ENV
from omni_mesh.export.roles import CONTROL_PORT


def peers_service(name: str) -> str:
    """The headless Service that gives each coordinator pod its DNS name."""
    return f"{name}-peers"


def control_endpoints(name: str, count: int) -> str:
    """Every coordinator's control endpoint, comma-separated (a stage's OMNI_MESH_COORDINATOR)."""
    return ",".join(f"tcp://{name}-{i}.{peers_service(name)}:{CONTROL_PORT}" for i in range(count))


def coordinator_id_env() -> dict[str, Any]:
    """The pod's own name as its coordinator id."""
    return {"name": COORDINATOR_ID_ENV, "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}


def stateful_set(deployment: dict[str, Any], name: str, count: int) -> dict[str, Any]:
    """The coordinator's Deployment as a StatefulSet of `count` pods (stable names, parallel start)."""
    spec = dict(deployment["spec"])
    spec.pop("strategy", None)
    spec["replicas"] = count
    spec["serviceName"] = peers_service(name)
    spec["podManagementPolicy"] = "Parallel"
    return {**deployment, "kind": "StatefulSet", "spec": spec}


def headless_service(service: dict[str, Any], name: str) -> dict[str, Any]:
    """The coordinators' control ports by pod name; not-ready pods too (their stages register first)."""
    spec = {
        "clusterIP": "None",
        "publishNotReadyAddresses": True,
        "selector": service["spec"]["selector"],
        "ports": [{"name": "control", "port": CONTROL_PORT, "targetPort": "control"}],
    }
    metadata = {**service["metadata"], "name": peers_service(name)}
    return {"apiVersion": "v1", "kind": "Service", "metadata": metadata, "spec": spec}


def disruption_budget(service: dict[str, Any], name: str) -> dict[str, Any]:
    """At most one coordinator away at a time (a node drain, an upgrade)."""
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": {**service["metadata"], "name": name},
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": service["spec"]["selector"]}},
    }
