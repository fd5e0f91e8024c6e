"""A topology as Kubernetes manifests: `omni-mesh export k8s TOPOLOGY`.

One YAML stream (`kubectl apply -f`), every object labelled with the mesh's name:
- the mesh keys as a Secret (with `--keys`; otherwise the stream names the Secret to create);
- the coordinator: a Deployment (one replica, recreated on change: one coordinator owns the mesh) and
  a Service for its REST port and its control plane;
- per pod of stages, a Deployment with the stages' replicas, probes and resources, and a
  HorizontalPodAutoscaler on the queue depth of its stages (`omni_mesh_stage_queued_requests{stage}`,
  which the coordinator exports at /metrics: an External metric, served by an adapter such as
  prometheus-adapter). Stages joined by a SharedMemoryConnector edge run in one pod (one container
  each, one /dev/shm), so they scale together; every other stage has a pod of its own;
- a Deployment and Service for each Mooncake store master the topology names by service.
"""

from __future__ import annotations

import base64
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omni_mesh.export import k8s_coordinators as several
from omni_mesh.export.hpa import ONGOING_METRIC, QUEUE_METRIC, hpa_spec
from omni_mesh.export.output import Exported, render
from omni_mesh.export.placement import SHM, crossing_warnings, describe, shm_edges, shm_groups
from omni_mesh.export.resources import Resources, stage_resources
from omni_mesh.export.roles import (
    CONTROL_PORT,
    COORDINATOR_STOP_GRACE_S,
    HTTP_PORT,
    KEYS_MOUNT,
    STAGE_HEALTH,
    STAGE_STOP_GRACE_S,
    StoreMaster,
    coordinator_env,
    stage_env,
    store_masters,
)
from omni_mesh.export.source import ExportError, ImageSource
from omni_mesh.security import KEY_BASENAME, MeshKeyError, MeshKeys
from omni_mesh.topology import StageSpec, Topology

IMAGE_UID = 10001  # the user services/Dockerfile runs as
KEYS_FILE = f"{KEY_BASENAME}.key_secret"
DEFAULT_REQUESTS = {"cpu": "250m", "memory": "512Mi"}
_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_MAX_LABEL = 63


@dataclass(frozen=True)
class K8sOptions:
    image: str = "omni-mesh:latest"
    name: str | None = None  # the prefix of every object's name; default: the topology's name
    keys: Path | None = None  # a mesh.key_secret (or its directory) to put in the Secret
    shm_size: str = "2Gi"  # /dev/shm of a pod whose stages share memory
    max_replicas: int | None = None  # each autoscaler's ceiling; default: 4 x the pod's replicas
    coordinators: int = 1  # more: a StatefulSet, its peers' Service and a disruption budget (k8s_coordinators)


def export_k8s(topology: Topology, source: ImageSource, options: K8sOptions | None = None) -> Exported:
    options = options or K8sOptions()
    mesh = _Mesh(topology, source, options)
    documents = [*mesh.secret(), *mesh.coordinator()]
    for master in mesh.masters:
        documents += mesh.master(master)
    for pod in mesh.pods:
        documents += [mesh.stage_pod(pod), mesh.autoscaler(pod)]
    warnings = crossing_warnings(topology) + mesh.warnings
    return Exported(render(documents, mesh.header()), warnings, secret=options.keys is not None)


@dataclass(frozen=True)
class _Pod:
    name: str  # the component name: the stages' names joined
    stages: list[StageSpec]
    replicas: int
    shares_memory: bool


class _Mesh:
    def __init__(self, topology: Topology, source: ImageSource, options: K8sOptions) -> None:
        self.topology = topology
        self.source = source
        self.options = options
        self.name = dns_label(options.name or topology.name, "--name")
        self.coordinator_name = self._object_name("coordinator")
        self.masters = store_masters(topology)
        for master in self.masters:
            dns_label(master.name, f"the Mooncake store master {master.name!r} (a Service of that name)", exact=True)
        self.pods = self._pods()
        self.warnings: list[str] = []
        if options.max_replicas is not None and options.max_replicas < max(p.replicas for p in self.pods):
            raise ExportError(f"--max-replicas {options.max_replicas} is below a pod's replicas in the topology")

    # ---------------------------------------------------------------------------------- pods of stages

    def _pods(self) -> list[_Pod]:
        containers: dict[str, str] = {}
        for stage in self.topology.stages:
            container = dns_label(stage.name, f"stage {stage.stage_id} {stage.name!r}")
            if container in containers:
                raise ExportError(
                    f"stages {containers[container]!r} and {stage.name!r} both become {container!r} in "
                    "Kubernetes names (lower case, '-' for '_' and '.'); rename one"
                )
            containers[container] = stage.name
        pods = []
        for group in shm_groups(self.topology):
            self._check_replicas(group)
            name = "-".join(dns_label(stage.name, "") for stage in group)
            self._object_name(name)  # checks the length
            shares = any(edge.src in _ids(group) for edge in shm_edges(self.topology))
            pods.append(_Pod(name, group, group[0].replicas, shares))
        return pods

    def _check_replicas(self, group: list[StageSpec]) -> None:
        for edge in shm_edges(self.topology):
            src, dst = self.topology.stage(edge.src), self.topology.stage(edge.dst)
            if edge.src in _ids(group) and src.replicas != dst.replicas:
                raise ExportError(
                    f"edge {describe(self.topology, edge)} uses {SHM}, so {src.name!r} and {dst.name!r} run in "
                    f"one pod and scale together, but they ask for {src.replicas} and {dst.replicas} replicas: "
                    "give them the same replicas, or carry this edge across pods with "
                    "MooncakeTransferEngineConnector (or ZmqConnector) with host: auto"
                )

    def stage_pod(self, pod: _Pod) -> dict[str, Any]:
        coordinator = f"tcp://{self.coordinator_name}:{CONTROL_PORT}"
        if self.options.coordinators > 1:  # one link to each coordinator pod, by its stable name
            coordinator = several.control_endpoints(self.coordinator_name, self.options.coordinators)
        containers = []
        for stage in pod.stages:
            container = {
                "name": dns_label(stage.name, ""),
                **self._container_base(),
                "command": ["omni-mesh", "stage"],
                "env": _env(stage_env(self.source.in_image, stage.name, coordinator=coordinator)),
                # Registered and heartbeating: the health file is touched at every heartbeat.
                "startupProbe": _exec_probe(STAGE_HEALTH, period_s=5, failures=24),  # 2 min to register
                "readinessProbe": _exec_probe(STAGE_HEALTH, period_s=5, failures=2),
                "livenessProbe": _exec_probe(STAGE_HEALTH, period_s=10, failures=6),
                "resources": _resources(stage_resources(stage)),
                "volumeMounts": self._mounts(pod.shares_memory),
            }
            containers.append(container)
        spec = self._pod_spec(containers, STAGE_STOP_GRACE_S, shares_memory=pod.shares_memory)
        return self._deployment(pod.name, pod.replicas, spec)

    def autoscaler(self, pod: _Pod) -> dict[str, Any]:
        """The pod's HorizontalPodAutoscaler, from its stages' autoscale: (omni_mesh.export.hpa)."""
        name = self._object_name(pod.name)
        target = {"apiVersion": "apps/v1", "kind": "Deployment", "name": name}
        spec, warnings = hpa_spec(pod.stages, pod.replicas, target, self.options.max_replicas)
        self.warnings += warnings
        return {
            "apiVersion": "autoscaling/v2",
            "kind": "HorizontalPodAutoscaler",
            "metadata": self._metadata(name, pod.name),
            "spec": spec,
        }

    # ---------------------------------------------------------------------------------- the coordinator

    def coordinator(self) -> list[dict[str, Any]]:
        probe = {"httpGet": {"path": "/health", "port": "http"}, "timeoutSeconds": 3}
        container = {
            "name": "coordinator",
            **self._container_base(),
            "command": ["omni-mesh", "coordinator"],
            "env": _env(
                coordinator_env(
                    self.source.in_image, host="0.0.0.0", port=HTTP_PORT, control_bind=f"tcp://0.0.0.0:{CONTROL_PORT}"
                )
            ),
            "ports": [
                {"name": "http", "containerPort": HTTP_PORT},
                {"name": "control", "containerPort": CONTROL_PORT},
            ],
            # /health, not /ready: stages reach the control plane through the Service only once the
            # coordinator is ready, and /ready waits for the stages.
            "startupProbe": {**probe, "periodSeconds": 2, "failureThreshold": 30},
            "readinessProbe": {**probe, "periodSeconds": 5, "failureThreshold": 2},
            "livenessProbe": {**probe, "periodSeconds": 10, "failureThreshold": 3},
            "resources": _resources(Resources()),
            "volumeMounts": self._mounts(False),
        }
        spec = self._pod_spec([container], COORDINATOR_STOP_GRACE_S, shares_memory=False)
        # Recreate: a new coordinator starts only once the old one is gone (one owns the mesh).
        deployment = self._deployment("coordinator", 1, spec, annotations=_scrape_annotations(), recreate=True)
        ports = [("http", HTTP_PORT), ("control", CONTROL_PORT)]
        service = self._service(self.coordinator_name, "coordinator", ports)
        count = self.options.coordinators
        if count == 1:
            return [deployment, service]
        container["env"].append(several.coordinator_id_env())
        return [
            several.stateful_set(deployment, self.coordinator_name, count),
            several.headless_service(service, self.coordinator_name), service,
            several.disruption_budget(service, self.coordinator_name),
        ]

    def master(self, master: StoreMaster) -> list[dict[str, Any]]:
        probe = {"tcpSocket": {"port": "rpc"}, "timeoutSeconds": 3}
        container = {
            "name": "mooncake-master",
            **self._container_base(),
            "command": master.command("0.0.0.0"),
            "ports": [{"name": "rpc", "containerPort": master.port}],
            "readinessProbe": {**probe, "periodSeconds": 5},
            "livenessProbe": {**probe, "periodSeconds": 10, "failureThreshold": 3},
            "resources": _resources(Resources()),
        }
        spec = self._pod_spec([container], COORDINATOR_STOP_GRACE_S, shares_memory=False, keys=False)
        deployment = self._deployment(master.name, 1, spec, object_name=master.name)
        return [deployment, self._service(master.name, master.name, [("rpc", master.port)])]

    # ---------------------------------------------------------------------------------- the mesh keys

    @property
    def secret_name(self) -> str:
        return self._object_name("mesh-keys")

    def secret(self) -> list[dict[str, Any]]:
        if self.options.keys is None:
            return []
        path = Path(self.options.keys)
        path = path if path.is_file() else path / KEYS_FILE
        try:
            MeshKeys.load(path)
            content = path.read_bytes()
        except (MeshKeyError, OSError) as exc:
            raise ExportError(f"--keys {self.options.keys}: {exc}") from None
        return [
            {
                "apiVersion": "v1",
                "kind": "Secret",
                "metadata": self._metadata(self.secret_name, "mesh-keys"),
                "type": "Opaque",
                "data": {KEYS_FILE: base64.b64encode(content).decode()},
            }
        ]

    # ---------------------------------------------------------------------------------- shared pieces

    def _object_name(self, component: str) -> str:
        name = f"{self.name}-{component}"
        if len(name) > _MAX_LABEL:
            raise ExportError(
                f"{name!r} is longer than {_MAX_LABEL} characters, the limit of a Kubernetes name; pass a "
                "shorter --name"
            )
        return name

    def _labels(self, component: str) -> dict[str, str]:
        return {
            "app.kubernetes.io/name": "omni-mesh",
            "app.kubernetes.io/instance": self.name,
            "app.kubernetes.io/component": component,
        }

    def _metadata(self, name: str, component: str) -> dict[str, Any]:
        return {"name": name, "labels": self._labels(component)}

    def _container_base(self) -> dict[str, Any]:
        return {"image": self.options.image, "imagePullPolicy": "IfNotPresent"}

    def _mounts(self, shares_memory: bool, keys: bool = True) -> list[dict[str, Any]]:
        mounts = [{"name": "mesh-keys", "mountPath": KEYS_MOUNT, "readOnly": True}] if keys else []
        if shares_memory:
            mounts.append({"name": "dshm", "mountPath": "/dev/shm"})
        return mounts

    def _pod_spec(
        self, containers: list[dict], grace_s: int, *, shares_memory: bool, keys: bool = True
    ) -> dict[str, Any]:
        volumes: list[dict[str, Any]] = []
        if keys:  # 0440 and fsGroup: readable by the image's user, by no one else
            volumes.append({"name": "mesh-keys", "secret": {"secretName": self.secret_name, "defaultMode": 0o440}})
        if shares_memory:  # one /dev/shm for the pod's containers, larger than the runtime's 64 MiB
            volumes.append({"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": self.options.shm_size}})
        spec: dict[str, Any] = {
            "securityContext": {
                "runAsNonRoot": True,
                "runAsUser": IMAGE_UID,
                "runAsGroup": IMAGE_UID,
                "fsGroup": IMAGE_UID,
            },
            "terminationGracePeriodSeconds": grace_s,
            "containers": containers,
        }
        if volumes:
            spec["volumes"] = volumes
        return spec

    def _deployment(
        self,
        component: str,
        replicas: int,
        pod_spec: dict[str, Any],
        *,
        annotations: dict[str, str] | None = None,
        object_name: str | None = None,
        recreate: bool = False,
    ) -> dict[str, Any]:
        template: dict[str, Any] = {"metadata": {"labels": self._labels(component)}, "spec": pod_spec}
        if annotations:
            template["metadata"]["annotations"] = annotations
        spec: dict[str, Any] = {"replicas": replicas, "selector": {"matchLabels": self._selector(component)}}
        if recreate:
            spec["strategy"] = {"type": "Recreate"}
        spec["template"] = template
        return {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": self._metadata(object_name or self._object_name(component), component),
            "spec": spec,
        }

    def _selector(self, component: str) -> dict[str, str]:
        labels = self._labels(component)
        return {key: labels[key] for key in ("app.kubernetes.io/instance", "app.kubernetes.io/component")}

    def _service(self, name: str, component: str, ports: list[tuple[str, int]]) -> dict[str, Any]:
        return {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": self._metadata(name, component),
            "spec": {
                "selector": self._selector(component),
                "ports": [{"name": port_name, "port": port, "targetPort": port_name} for port_name, port in ports],
            },
        }

    def header(self) -> list[str]:
        lines = [
            f"Generated from {self.source.relative} by `omni-mesh export k8s`. Apply with `kubectl apply -f FILE`.",
            f"Image: {self.options.image} (build services/Dockerfile and push it where the cluster pulls from).",
        ]
        if self.options.keys is None:
            lines += [
                f"Mesh keys: create the Secret {self.secret_name} first (or export with --keys DIR):",
                f"  kubectl create secret generic {self.secret_name} --from-file={KEYS_FILE}=compose/keys/{KEYS_FILE}",
            ]
        lines += [
            f"Autoscaling reads the External metrics {ONGOING_METRIC} (stages with autoscale:) and",
            f"{QUEUE_METRIC} (the others) per stage (docs/deployment.md: the prometheus-adapter rule).",
        ]
        return lines


def dns_label(text: str, who: str, *, exact: bool = False) -> str:
    """`text` as a Kubernetes name (lower case, '-' for anything else); `exact`: it must be one already."""
    label = re.sub(r"[^a-z0-9-]+", "-", text.lower()).strip("-")
    if exact and label != text:
        raise ExportError(f"{who}: {text!r} is not a valid Kubernetes name (lower case letters, digits, '-')")
    if not _LABEL.match(label) or len(label) > _MAX_LABEL:
        raise ExportError(f"{who}: {text!r} does not make a Kubernetes name (at most {_MAX_LABEL} characters)")
    return label


def _ids(stages: list[StageSpec]) -> set[int]:
    return {stage.stage_id for stage in stages}


def _env(values: dict[str, str]) -> list[dict[str, str]]:
    return [{"name": name, "value": value} for name, value in values.items()]


def _exec_probe(command: list[str], *, period_s: int, failures: int) -> dict[str, Any]:
    return {"exec": {"command": command}, "periodSeconds": period_s, "timeoutSeconds": 3, "failureThreshold": failures}


def _resources(resources: Resources) -> dict[str, Any]:
    requests: dict[str, Any] = {**DEFAULT_REQUESTS}
    limits: dict[str, Any] = {}
    if resources.cpu:
        requests["cpu"] = resources.cpu
    if resources.memory:
        requests["memory"] = limits["memory"] = resources.memory
    if resources.gpus:  # devices are whole: requests and limits alike
        requests[resources.gpu_type] = limits[resources.gpu_type] = str(resources.gpus)
    return {"requests": requests, **({"limits": limits} if limits else {})}


def _scrape_annotations() -> dict[str, str]:
    """Prometheus' usual pod annotations: scrape the coordinator's /metrics."""
    return {"prometheus.io/scrape": "true", "prometheus.io/port": str(HTTP_PORT), "prometheus.io/path": "/metrics"}
