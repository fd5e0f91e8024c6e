"""`omni-mesh export compose|k8s`: the topology is the one source of truth.

- The committed one-host compose files are the exporter's output, byte for byte.
- The host-network variant (what test_docker_compose.py runs) keeps every service on 127.0.0.1.
- Kubernetes manifests pass the schemas of the current Kubernetes release (kubernetes-validate, strict),
  and every shared-memory edge stays inside one pod, or the export refuses, naming the edge.

compose/docker-compose.host-a.yml and .host-b.yml stay hand-written: a topology says nothing about
which host runs which stage.
"""

from __future__ import annotations

import base64
import shutil
import subprocess
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from support.servicekit import COMPOSE, OMNI_MESH, REPO, compose_config

from omni_mesh.export import ComposeOptions, ExportError, ImageSource, K8sOptions, export_compose, export_k8s
from omni_mesh.security import MeshKeys
from omni_mesh.topology import load_topology

GENERATED = {
    "docker-compose.yml": "omni-demo.yaml",
    "docker-compose.mooncake-store.yml": "omni-demo-mooncake-store.yaml",
}
TOPOLOGIES = sorted(COMPOSE.glob("*.yaml"))
K8S_VERSION = kubernetes_validate.utils.latest_version()
DEMO_STAGES = ["thinker", "talker", "code2wav"]


def export(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    return subprocess.run([str(OMNI_MESH), "export", *args], cwd=cwd, capture_output=True, text=True, timeout=60)


# ====================================================================== compose


@pytest.mark.parametrize("compose_file", sorted(GENERATED), ids=str)
def test_committed_compose_files_are_the_exports_output(compose_file: str) -> None:
    topology = load_topology(COMPOSE / GENERATED[compose_file])
    expected = export_compose(topology, ImageSource.find(topology), COMPOSE / compose_file).text
    assert (COMPOSE / compose_file).read_text() == expected, (
        f"compose/{compose_file} is not what its topology exports; regenerate it:\n"
        f"  omni-mesh export compose compose/{GENERATED[compose_file]} -o compose/{compose_file}"
    )


def test_export_to_a_file_writes_exactly_the_committed_file(tmp_path: Path) -> None:
    copy = tmp_path / "repo"
    for part in ("compose", "services"):
        shutil.copytree(REPO / part, copy / part, ignore=shutil.ignore_patterns("keys", "__pycache__"))
    (copy / "compose" / "docker-compose.yml").unlink()
    result = export("compose", "compose/omni-demo.yaml", "-o", "compose/docker-compose.yml", cwd=copy)
    assert result.returncode == 0 and result.stdout == "", result.stderr
    assert (copy / "compose" / "docker-compose.yml").read_text() == (COMPOSE / "docker-compose.yml").read_text()


def test_the_compose_file_follows_the_topology(tmp_path: Path) -> None:
    """Replicas become `scale`, GPUs device reservations, a store master its own service; no shared
    memory edge, no shared IPC."""
    stage = {"replicas": 2, "resources": {"gpus": 1, "memory": "16Gi"}}
    path = _topology_file(tmp_path, "gpu.yaml", _pair("gpu-demo", "ZmqConnector", ("encode", "decode"), stage))
    topology = load_topology(path)
    output = path.parent / "docker-compose.yml"
    output.write_text(export_compose(topology, ImageSource.find(topology), output).text)
    services = compose_config(output)["services"]
    assert set(services) == {"coordinator", "encode", "decode"}
    assert services["encode"]["scale"] == 2 and "scale" not in services["decode"]
    assert services["encode"]["deploy"]["resources"]["reservations"]["devices"] == [
        {"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}
    ]
    assert all("ipc" not in spec for spec in services.values())


def test_host_network_variant_listens_on_loopback_only() -> None:
    topology = load_topology(COMPOSE / "omni-demo.yaml")
    options = ComposeOptions("host", http_port=18080, control_port=18555)
    text = export_compose(topology, ImageSource.find(topology), COMPOSE / "docker-compose.yml", options).text
    document = yaml.safe_load(text)
    services = document["services"]
    assert set(services) == {"coordinator", *DEMO_STAGES}
    for name, spec in services.items():
        assert spec["network_mode"] == "host" and "ports" not in spec, name
        assert spec["build"]["network"] == "host"
    env = services["coordinator"]["environment"]
    assert (env["OMNI_MESH_HOST"], env["OMNI_MESH_PORT"]) == ("127.0.0.1", "18080")
    assert env["OMNI_MESH_CONTROL_BIND"] == "tcp://127.0.0.1:18555"
    for stage in DEMO_STAGES:
        assert services[stage]["environment"]["OMNI_MESH_COORDINATOR"] == "tcp://127.0.0.1:18555"
        assert services[stage]["ipc"] == "service:coordinator"
    with pytest.raises(ExportError, match="both 8000"):
        ComposeOptions("host", http_port=8000, control_port=8000)


def _several(tmp_path: Path, *args: str) -> dict:
    """omni-demo exported by the CLI with `args`, next to a copy of the demo (so its paths resolve), as
    `docker-compose config` resolves it."""
    topology = _topology_file(tmp_path, "omni-demo.yaml", yaml.safe_load((COMPOSE / "omni-demo.yaml").read_text()))
    output = topology.parent / "docker-compose.yml"
    result = export("compose", str(topology), *args, "-o", str(output))
    assert result.returncode == 0, result.stderr
    assert yaml.safe_load(output.read_text()) is not None
    return compose_config(output)


def test_compose_several_coordinators_share_the_published_rest_port(tmp_path: Path) -> None:
    """--coordinators 3, bridge: c0 publishes the one REST port; the others join its network namespace
    and bind the port with SO_REUSEPORT, each with its own control and REST port (its health check) and
    the status volume; every stage is given every control endpoint and waits for every coordinator."""
    document = _several(tmp_path, "--coordinators", "3")
    services = document["services"]
    coordinators = ["coordinator", "coordinator-1", "coordinator-2"]
    assert set(services) == {*coordinators, *DEMO_STAGES}
    assert "coordinators" in document["volumes"]
    for index, name in enumerate(coordinators):
        spec = services[name]
        assert spec["command"] == ["omni-mesh", "coordinator", "--reuse-port", "--own-port", str(8001 + index)]
        env = spec["environment"]
        assert (env["OMNI_MESH_PORT"], env["OMNI_MESH_CONTROL_BIND"]) == ("8000", f"tcp://0.0.0.0:{5555 + index}")
        assert (env["OMNI_MESH_COORDINATOR_ID"], env["OMNI_MESH_COORDINATORS_DIR"]) == (
            f"c{index}",
            "/var/lib/omni-mesh/coordinators",
        )
        mount = spec["volumes"][0]  # compose v1 resolves it to `source:target:rw`, v2 to a mapping
        mount = mount.split(":")[:2] if isinstance(mount, str) else [mount["source"], mount["target"]]
        assert len(spec["volumes"]) == 1 and mount == ["coordinators", "/var/lib/omni-mesh/coordinators"], name
        assert f"127.0.0.1:{8001 + index}/health" in " ".join(spec["healthcheck"]["test"]), name
        assert spec["restart"] == "unless-stopped" and spec["stop_grace_period"] in ("15s", 15, 15_000_000_000)
        if index:
            assert spec["network_mode"] == "service:coordinator" and "ports" not in spec, name
            assert spec["ipc"] == "service:coordinator", name  # the demo's stages share memory
            assert "coordinator" in spec["depends_on"], name
    assert len(services["coordinator"]["ports"]) == 1 and "network_mode" not in services["coordinator"]
    for stage in DEMO_STAGES:
        env = services[stage]["environment"]
        assert env["OMNI_MESH_COORDINATOR"] == "tcp://coordinator:5555,tcp://coordinator:5556,tcp://coordinator:5557"
        assert set(coordinators) <= set(services[stage]["depends_on"]), stage


def test_compose_several_coordinators_on_the_host_network_stay_on_loopback(tmp_path: Path) -> None:
    document = _several(
        tmp_path, "--network", "host", "--http-port", "18000", "--control-port", "18555", "--coordinators", "2"
    )
    services = document["services"]
    for index, name in enumerate(["coordinator", "coordinator-1"]):
        spec = services[name]
        assert spec["network_mode"] == "host" and "ports" not in spec, name
        assert spec["command"][-2:] == ["--own-port", str(18001 + index)]
        env = spec["environment"]
        assert (env["OMNI_MESH_HOST"], env["OMNI_MESH_PORT"]) == ("127.0.0.1", "18000")
        assert env["OMNI_MESH_CONTROL_BIND"] == f"tcp://127.0.0.1:{18555 + index}"
    for stage in DEMO_STAGES:
        assert services[stage]["environment"]["OMNI_MESH_COORDINATOR"] == "tcp://127.0.0.1:18555,tcp://127.0.0.1:18556"
    # The own REST ports (18001-18002) must not run into the control ports.
    result = export("compose", "compose/omni-demo.yaml", "--network", "host", "--http-port", "18000",
                    "--control-port", "18002", "--coordinators", "2")
    assert result.returncode == 2 and "--coordinators 2" in result.stderr and "overlap" in result.stderr
    result = export("compose", "compose/omni-demo.yaml", "--coordinators", "0")
    assert result.returncode == 2 and "at least 1" in result.stderr


def test_compose_one_coordinator_is_the_file_of_today() -> None:
    assert export("compose", "compose/omni-demo.yaml", "--coordinators", "1").stdout == export(
        "compose", "compose/omni-demo.yaml"
    ).stdout
    header = export("compose", "compose/omni-demo.yaml", "--coordinators", "2").stdout.split("services:")[0]
    assert "--coordinators 2" in header and "restarted too" in header


def test_export_refuses_what_it_cannot_deploy(tmp_path: Path) -> None:
    named = _topology_file(tmp_path, "named.yaml", {"stages": [{"stage_id": 0, "name": "coordinator", "handler": "m:f"}]})
    result = export("compose", str(named))
    assert result.returncode == 2 and "stage 'coordinator'" in result.stderr and "rename" in result.stderr
    outside = tmp_path / "elsewhere.yaml"
    outside.write_text(yaml.safe_dump({"stages": [{"stage_id": 0, "name": "a", "handler": "m:f"}]}))
    result = export("compose", str(outside))
    assert result.returncode == 2 and "--context" in result.stderr
    result = export("compose", str(outside), "--context", str(named.parents[1]))
    assert result.returncode == 2 and "not inside the build context" in result.stderr


def test_export_warns_about_edges_that_cannot_cross_containers() -> None:
    result = export("compose", "compose/omni-demo-zmq-yuanrong.yaml")
    assert result.returncode == 0
    assert "edge 0->1 (thinker -> talker): ZmqConnector advertises host 127.0.0.1" in result.stderr
    assert "edge 1->2 (talker -> code2wav): YuanrongConnector needs an openYuanrong datasystem worker" in result.stderr


# ====================================================================== Kubernetes


def _manifests(topology_path: Path, **options: object) -> list[dict]:
    topology = load_topology(topology_path)
    text = export_k8s(topology, ImageSource.find(topology), K8sOptions(**options)).text  # type: ignore[arg-type]
    return list(yaml.safe_load_all(text))


@pytest.mark.parametrize("path", TOPOLOGIES, ids=lambda p: p.name)
def test_k8s_manifests_pass_the_current_kubernetes_schemas(path: Path, tmp_path: Path) -> None:
    keys = MeshKeys.generate().write(tmp_path)
    documents = _manifests(path, keys=keys, image="registry.example/omni-mesh:0.1.0")
    for document in documents:
        kubernetes_validate.validate(document, K8S_VERSION, strict=True)  # raises, naming the field
    kinds = [d["kind"] for d in documents]
    assert kinds.count("Secret") == 1 and kinds.count("Service") >= 1 and "HorizontalPodAutoscaler" in kinds
    names = [(d["kind"], d["metadata"]["name"]) for d in documents]
    assert len(names) == len(set(names)), names


@pytest.mark.parametrize("path", TOPOLOGIES, ids=lambda p: p.name)
def test_k8s_every_shared_memory_edge_stays_inside_one_pod(path: Path) -> None:
    topology = load_topology(path)
    pods = {
        d["metadata"]["name"]: d["spec"]["template"]["spec"]
        for d in _manifests(path)
        if d["kind"] == "Deployment"
    }
    pod_of = {
        {e["name"]: e["value"] for e in container["env"]}["OMNI_MESH_STAGE"]: name
        for name, spec in pods.items()
        for container in spec["containers"]
        if container["command"] == ["omni-mesh", "stage"]
    }
    assert set(pod_of) == {stage.name for stage in topology.stages}, "every stage runs in exactly one pod"
    for edge in topology.edges:
        src, dst = topology.stage(edge.src).name, topology.stage(edge.dst).name
        if edge.connector.name != "SharedMemoryConnector":
            continue
        assert pod_of[src] == pod_of[dst], f"edge {edge.label} crosses pods"
        spec = pods[pod_of[src]]
        assert {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "2Gi"}} in spec["volumes"]
        for container in spec["containers"]:
            assert {"name": "dshm", "mountPath": "/dev/shm"} in container["volumeMounts"], container["name"]


def test_k8s_demo_is_a_coordinator_and_one_pod_of_three_stages(tmp_path: Path) -> None:
    keys = MeshKeys.generate().write(tmp_path)
    documents = {(d["kind"], d["metadata"]["name"]): d for d in _manifests(COMPOSE / "omni-demo.yaml", keys=tmp_path)}
    secret = documents["Secret", "qwen-omni-demo-mesh-keys"]
    assert base64.b64decode(secret["data"]["mesh.key_secret"]) == keys.read_bytes()
    coordinator = documents["Deployment", "qwen-omni-demo-coordinator"]["spec"]
    assert coordinator["replicas"] == 1 and coordinator["strategy"] == {"type": "Recreate"}
    container = coordinator["template"]["spec"]["containers"][0]
    assert container["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert coordinator["template"]["metadata"]["annotations"]["prometheus.io/path"] == "/metrics"
    service = documents["Service", "qwen-omni-demo-coordinator"]["spec"]
    assert [(p["name"], p["port"]) for p in service["ports"]] == [("http", 8000), ("control", 5555)]
    pod = documents["Deployment", "qwen-omni-demo-thinker-talker-code2wav"]["spec"]
    assert [c["name"] for c in pod["template"]["spec"]["containers"]] == DEMO_STAGES
    for c in pod["template"]["spec"]["containers"]:
        env = {e["name"]: e["value"] for e in c["env"]}
        assert env["OMNI_MESH_COORDINATOR"] == "tcp://qwen-omni-demo-coordinator:5555"
        assert env["OMNI_MESH_TOPOLOGY"] == "/app/compose/omni-demo.yaml"
        assert {"readinessProbe", "livenessProbe", "startupProbe"} <= set(c)
    hpa = documents["HorizontalPodAutoscaler", "qwen-omni-demo-thinker-talker-code2wav"]["spec"]
    assert hpa["scaleTargetRef"]["name"] == "qwen-omni-demo-thinker-talker-code2wav"
    assert [m["external"]["metric"] for m in hpa["metrics"]] == [
        {"name": "omni_mesh_stage_queued_requests", "selector": {"matchLabels": {"stage": stage}}}
        for stage in DEMO_STAGES
    ]


def test_k8s_stages_apart_get_their_own_pods_autoscalers_and_gpus(tmp_path: Path) -> None:
    stage = {"replicas": 2, "resources": {"gpus": 2, "memory": "40Gi", "cpu": 8}}
    pair = _pair("Split_Demo", "MooncakeTransferEngineConnector", ("thinker", "talker"), stage)
    path = _topology_file(tmp_path, "split.yaml", pair)
    documents = {(d["kind"], d["metadata"]["name"]): d for d in _manifests(path, max_replicas=6)}
    for document in documents.values():
        kubernetes_validate.validate(document, K8S_VERSION, strict=True)
    thinker = documents["Deployment", "split-demo-thinker"]["spec"]
    assert thinker["replicas"] == 2
    resources = thinker["template"]["spec"]["containers"][0]["resources"]
    assert resources == {
        "requests": {"cpu": "8", "memory": "40Gi", "nvidia.com/gpu": "2"},
        "limits": {"memory": "40Gi", "nvidia.com/gpu": "2"},
    }
    assert "volumes" in thinker["template"]["spec"] and all(
        v["name"] != "dshm" for v in thinker["template"]["spec"]["volumes"]
    )
    hpa = documents["HorizontalPodAutoscaler", "split-demo-thinker"]["spec"]
    assert (hpa["minReplicas"], hpa["maxReplicas"]) == (2, 6)
    assert ("Deployment", "split-demo-talker") in documents


def test_k8s_refuses_a_shared_memory_edge_between_stages_that_scale_apart(tmp_path: Path) -> None:
    demo = yaml.safe_load((COMPOSE / "omni-demo.yaml").read_text())
    demo["stages"][1]["replicas"] = 3
    path = _topology_file(tmp_path, "apart.yaml", demo)
    result = export("k8s", str(path))
    assert result.returncode == 2
    assert "edge 0->1 (thinker -> talker) uses SharedMemoryConnector" in result.stderr
    assert "MooncakeTransferEngineConnector" in result.stderr and "1 and 3 replicas" in result.stderr


@pytest.mark.parametrize(
    ("resources", "message"),
    [
        ({"gpus": -1}, "resources.gpus must be a whole number"),
        ({"gpu": 1}, "resources: unknown key 'gpu'"),
        ({"memory": "lots"}, "resources.memory must be bytes or a size"),
        ({"cpu": 0}, "resources.cpu must be a number of cores"),
        ({"gpus": 1, "gpu_type": "GPU"}, "resources.gpu_type must be a device plugin's resource name"),
        ("big", "resources must be a mapping"),
    ],
)
def test_bad_resources_are_refused_naming_the_stage(tmp_path: Path, resources: object, message: str) -> None:
    stage = {"stage_id": 0, "name": "solo", "handler": "m:f", "resources": resources}
    topology = load_topology(_topology_file(tmp_path, "bad.yaml", {"stages": [stage]}))
    with pytest.raises(ExportError, match=f"stage 0 'solo': {message}"):
        export_k8s(topology, ImageSource.find(topology))


def test_k8s_export_to_stdout_and_file_agree(tmp_path: Path) -> None:
    stdout = export("k8s", "compose/omni-demo.yaml")
    assert stdout.returncode == 0, stdout.stderr
    out = tmp_path / "mesh.yaml"
    to_file = export("k8s", "compose/omni-demo.yaml", "-o", str(out))
    assert to_file.returncode == 0 and out.read_text() == stdout.stdout
    assert "kubectl create secret generic qwen-omni-demo-mesh-keys" in stdout.stdout  # no --keys: say how


@pytest.mark.parametrize("before", [None, 0o644, 0o666], ids=["new file", "over 0644", "over 0666"])
def test_k8s_export_with_keys_writes_a_file_only_its_owner_reads(tmp_path: Path, before: int | None) -> None:
    keys = MeshKeys.generate().write(tmp_path / "keys")
    out = tmp_path / "mesh.yaml"
    if before is not None:  # an earlier export (or anything else) left a wider file there
        out.write_text("old")
        out.chmod(before)
    result = export("k8s", "compose/omni-demo.yaml", "--keys", str(keys.parent), "-o", str(out))
    assert result.returncode == 0, result.stderr
    assert out.stat().st_mode & 0o777 == 0o600, oct(out.stat().st_mode)
    assert base64.b64encode(keys.read_bytes()).decode() in out.read_text()
    without = tmp_path / "no-keys.yaml"  # no secret in it: readable like any generated file
    assert export("k8s", "compose/omni-demo.yaml", "-o", str(without)).returncode == 0
    assert without.stat().st_mode & 0o777 == 0o644


def test_keys_generate_writes_the_secret_key_0600_whatever_the_umask(tmp_path: Path) -> None:
    result = subprocess.run(
        [str(OMNI_MESH), "keys", "generate", str(tmp_path / "keys")],
        capture_output=True, text=True, timeout=60, umask=0,
    )
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "keys" / "mesh.key_secret").stat().st_mode & 0o777 == 0o600


def _topology_file(tmp_path: Path, name: str, topology: dict) -> Path:
    """`topology` written as compose/NAME in a build context of our own (with services/Dockerfile)."""
    context = tmp_path / "context"
    (context / "compose").mkdir(parents=True, exist_ok=True)
    dockerfile = context / "services" / "Dockerfile"
    if not dockerfile.exists():
        dockerfile.parent.mkdir()
        shutil.copy2(REPO / "services" / "Dockerfile", dockerfile)
    path = context / "compose" / name
    path.write_text(yaml.safe_dump(topology))
    return path


def _pair(name: str, connector: str, stages: tuple[str, str], first: dict) -> dict:
    """A topology of two stages, 0 -> 1 over `connector` (host: auto); `first`: more keys of stage 0."""
    return {
        "name": name,
        "connectors": {"link": {"name": connector, "extra": {"host": "auto"}}},
        "stages": [
            {"stage_id": 0, "name": stages[0], "handler": "m:f", **first, "output_connectors": {"to_stage_1": "link"}},
            {"stage_id": 1, "name": stages[1], "handler": "m:f", "input_connectors": {"from_stage_0": "link"}},
        ],
    }


def test_k8s_several_coordinators_are_a_stateful_set_behind_one_service_with_a_disruption_budget(
    tmp_path: Path,
) -> None:
    MeshKeys.generate().write(tmp_path)
    manifests = _manifests(COMPOSE / "omni-demo.yaml", keys=tmp_path, coordinators=3)
    for document in manifests:
        kubernetes_validate.validate(document, K8S_VERSION, strict=True)
    documents = {(d["kind"], d["metadata"]["name"]): d for d in manifests}
    assert ("Deployment", "qwen-omni-demo-coordinator") not in documents
    coordinators = documents["StatefulSet", "qwen-omni-demo-coordinator"]["spec"]
    assert coordinators["replicas"] == 3 and coordinators["serviceName"] == "qwen-omni-demo-coordinator-peers"
    container = coordinators["template"]["spec"]["containers"][0]
    assert container["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert {"name": "OMNI_MESH_COORDINATOR_ID", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}} in container["env"]
    peers = documents["Service", "qwen-omni-demo-coordinator-peers"]["spec"]
    assert peers["clusterIP"] == "None" and peers["selector"] == coordinators["selector"]["matchLabels"]
    rest = documents["Service", "qwen-omni-demo-coordinator"]["spec"]
    assert rest["selector"] == coordinators["selector"]["matchLabels"]
    budget = documents["PodDisruptionBudget", "qwen-omni-demo-coordinator"]["spec"]
    assert budget == {"maxUnavailable": 1, "selector": coordinators["selector"]}
    pod = documents["Deployment", "qwen-omni-demo-thinker-talker-code2wav"]["spec"]
    for c in pod["template"]["spec"]["containers"]:
        env = {e["name"]: e["value"] for e in c["env"]}
        assert env["OMNI_MESH_COORDINATOR"] == ",".join(
            f"tcp://qwen-omni-demo-coordinator-{i}.qwen-omni-demo-coordinator-peers:5555" for i in range(3)
        )
