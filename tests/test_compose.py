"""The compose files: valid for docker-compose, shaped for `--scale`, and runnable as they are.

These checks need no Docker engine: `docker-compose config` checks each file, and the services of
compose/docker-compose.yml (and of the Mooncake store variant) run as local processes with exactly
their `command`, `environment` and `healthcheck` (servicekit.localize maps /app to this repository,
service names to 127.0.0.1 and their ports to free ones). Local processes share /dev/shm the way the
stage containers share the coordinator's IPC namespace (`ipc: "service:coordinator"`).
tests/test_docker_compose.py builds the image and runs the demo with `docker compose` for real;
tests/test_export.py checks that the one-host files are the exporter's output.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import yaml
from support.meshkit import wait_for
from support.servicekit import (
    COMPOSE,
    OMNI_MESH,
    REPO,
    Api,
    Services,
    compose_config,
    docker_compose,
    localize,
    run_healthcheck,
)

from omni_mesh.ports import free_port
from omni_mesh.topology import load_topology

COMPOSE_FILES = sorted(COMPOSE.glob("docker-compose*.yml"))
MAIN = COMPOSE / "docker-compose.yml"
STORE = COMPOSE / "docker-compose.mooncake-store.yml"
DEMO_STAGES = ["thinker", "talker", "code2wav"]


def test_the_compose_files_are_there() -> None:
    assert {p.name for p in COMPOSE_FILES} >= {
        "docker-compose.host-a.yml",
        "docker-compose.host-b.yml",
        "docker-compose.mooncake-store.yml",
        "docker-compose.yml",
    }
    assert (REPO / "services" / "Dockerfile").is_file() and (REPO / ".dockerignore").is_file()


def test_dockerfile_builds_one_cache_friendly_image() -> None:
    """What the image promises, line by line (test_docker_compose.py builds and runs it)."""
    lines = [line.strip() for line in (REPO / "services" / "Dockerfile").read_text().splitlines()]
    instructions = [line for line in lines if line and not line.startswith("#")]
    assert "ARG PYTHON_IMAGE=python:3.11-slim" in instructions and "FROM ${PYTHON_IMAGE}" in instructions
    assert "ARG TORCH=cpu" in instructions and "ARG TORCH_VERSION=2.13.0" in instructions
    assert "ARG TORCH_INDEX_URL=" in instructions  # empty: no index host is written anywhere
    text = "\n".join(instructions)
    for library in ("libibverbs1", "libnuma1", "libcurl4"):  # Mooncake's engine.so, store.so, mooncake_master
        assert library in text, library
    assert "extras[mooncake]" in text and "extras['yuanrong']" in text
    assert "import omni_mesh.cli, services.omni_demo.stages, mooncake.engine, mooncake.store, yr.datasystem" in text
    # Dependencies are installed from pyproject.toml alone, before any source is copied.
    copies = [i for i, line in enumerate(instructions) if line.startswith("COPY ")]
    assert instructions[copies[0]] == "COPY pyproject.toml ./"
    first_source = next(i for i in copies if "omni_mesh" in instructions[i])
    assert any("pip install -r" in line for line in instructions[copies[0] : first_source])
    assert instructions[-1] == 'CMD ["omni-mesh", "--help"]'
    assert subprocess.run([str(OMNI_MESH), "--help"], capture_output=True, timeout=60).returncode == 0
    ignored = (REPO / ".dockerignore").read_text().split()
    assert {".git", ".venv", ".pytest_cache", "**/__pycache__", "compose/keys"} <= set(ignored)
    for path in [REPO / "services" / "Dockerfile", *COMPOSE.glob("*.y*ml")]:
        assert "pytorch.org/whl" not in path.read_text() and "download.pytorch" not in path.read_text(), path


@pytest.mark.parametrize("path", COMPOSE_FILES, ids=lambda p: p.name)
def test_docker_compose_config_accepts(path: Path) -> None:
    result = subprocess.run(
        [docker_compose(), "-f", path.name, "config", "--quiet"],
        cwd=COMPOSE,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("path", COMPOSE_FILES, ids=lambda p: p.name)
def test_every_service_runs_the_one_image_with_a_healthcheck_and_a_valid_topology(path: Path) -> None:
    config = compose_config(path)
    for name, spec in config["services"].items():
        assert spec["image"] == "omni-mesh:latest", name
        assert spec["build"]["dockerfile"] == "services/Dockerfile" and Path(spec["build"]["context"]) == REPO
        assert spec["healthcheck"]["test"][0] == "CMD", f"{name}: no healthcheck"
        assert "container_name" not in spec, f"{name}: container_name prevents --scale"
        topology = (spec.get("environment") or {}).get("OMNI_MESH_TOPOLOGY")
        if topology:
            assert topology.startswith("/app/compose/"), topology
            load_topology(REPO / topology.removeprefix("/app/"))  # raises if invalid


def test_main_compose_file_scales_stages_and_shares_ipc() -> None:
    raw = yaml.safe_load(MAIN.read_text())
    assert "version" not in raw  # obsolete in the Compose Specification: `docker compose` warns
    services = compose_config(MAIN)["services"]
    assert set(services) == {"coordinator", *DEMO_STAGES}
    coordinator = services["coordinator"]
    assert coordinator["ipc"] == "shareable" and coordinator.get("shm_size")
    assert [_published(p) for p in coordinator["ports"]] == [("127.0.0.1", 8000)]  # REST only, on loopback
    for stage in DEMO_STAGES:
        spec = services[stage]
        assert spec["ipc"] == "service:coordinator"
        assert "ports" not in spec, f"{stage}: a published port prevents --scale"
        assert spec["command"] == ["omni-mesh", "stage"]
        assert spec["environment"]["OMNI_MESH_STAGE"] == stage
        assert spec["environment"]["OMNI_MESH_COORDINATOR"] == "tcp://coordinator:5555"
        assert "OMNI_MESH_REPLICA" not in spec["environment"], "a fixed replica id breaks --scale"
        assert spec["depends_on"]["coordinator"]["condition"] == "service_healthy"


def _published(port: str | dict) -> tuple[str, int]:
    """(host address, container port) of a resolved `ports:` entry, short (v1 with an address) or long."""
    if isinstance(port, dict):
        return port.get("host_ip", "0.0.0.0"), int(port["target"])
    address, _published_port, target = port.split("/")[0].rsplit(":", 2)
    return address, int(target)


def test_multihost_compose_files_split_the_demo_over_two_hosts() -> None:
    a = compose_config(COMPOSE / "docker-compose.host-a.yml")["services"]
    b = compose_config(COMPOSE / "docker-compose.host-b.yml", {"OMNI_MESH_COORDINATOR_HOST": "10.1.2.3"})[
        "services"
    ]
    assert set(a) == {"coordinator", "thinker"} and set(b) == {"talker", "code2wav"}
    for spec in [*a.values(), *b.values()]:
        assert spec["network_mode"] == "host" and spec["ipc"] == "host"
        assert spec["environment"]["OMNI_MESH_TOPOLOGY"] == "/app/compose/omni-demo-multihost.yaml"
    assert a["thinker"]["environment"]["OMNI_MESH_COORDINATOR"] == "tcp://127.0.0.1:5555"
    assert {s["environment"]["OMNI_MESH_COORDINATOR"] for s in b.values()} == {"tcp://10.1.2.3:5555"}
    default = compose_config(COMPOSE / "docker-compose.host-b.yml", {"OMNI_MESH_COORDINATOR_HOST": ""})
    assert default["services"]["talker"]["environment"]["OMNI_MESH_COORDINATOR"] == "tcp://host-a:5555"
    topology = load_topology(COMPOSE / "omni-demo-multihost.yaml")
    assert {e.label: e.connector.name for e in topology.edges} == {
        "0->1": "MooncakeTransferEngineConnector",
        "1->2": "SharedMemoryConnector",
    }
    store = load_topology(COMPOSE / "omni-demo-mooncake-store.yaml")
    assert {e.label: e.connector.name for e in store.edges} == {
        "0->1": "MooncakeStoreConnector",
        "1->2": "SharedMemoryConnector",
    }
    assert store.edges[0].connector.extra["master"] == "mooncake-master:50051"


# ====================================================================== running the files' services


class LocalCompose:
    """The services of one compose file running as local processes (`scale` replicas of each)."""

    def __init__(self, path: Path, scratch: Path, ports: dict[str, list[int]]) -> None:
        self.config = compose_config(path)
        self.scratch = scratch
        self.ports = {service: {port: free_port() for port in listed} for service, listed in ports.items()}
        self.services = Services(scratch / "logs")
        self.instances: dict[str, list] = {}

    def start(self, service: str, count: int = 1) -> list:
        started = []
        for _ in range(count):
            index = len(self.instances.setdefault(service, [])) + 1
            local = localize(
                self.config, service, scratch=self.scratch, instance=f"{service}-{index}", ports=self.ports
            )
            process = self.services.start(local.name, local.argv, env=local.env)
            self.instances[service].append((local, process))
            started.append((local, process))
        return started

    def url(self) -> str:
        return f"http://127.0.0.1:{self.ports['coordinator'][8000]}"


@pytest.fixture
def demo_compose(tmp_path: Path) -> Iterator[LocalCompose]:
    mesh = LocalCompose(MAIN, tmp_path, {"coordinator": [5555, 8000]})
    with mesh.services:
        yield mesh


def _all_healthchecks(mesh: LocalCompose, tries: int = 3) -> dict[str, int]:
    """Each running service's healthcheck status, tried up to `tries` times a second apart: as the
    compose files' `retries: 3`, one late heartbeat on a loaded machine is not yet unhealthy."""
    checks = {}
    for instances in mesh.instances.values():
        for local, process in instances:
            if not process.running():
                continue
            for attempt in range(tries):
                checks[local.name] = run_healthcheck(local)
                if checks[local.name] == 0:
                    break
                if attempt + 1 < tries:
                    time.sleep(1)
    return checks


def test_main_compose_services_run_locally_scale_and_stop_cleanly(demo_compose: LocalCompose) -> None:
    mesh = demo_compose
    ((coordinator_local, coordinator),) = mesh.start("coordinator")
    # depends_on: coordinator: service_healthy -- its healthcheck passes before any stage starts.
    wait_for(lambda: run_healthcheck(coordinator_local) == 0, 60, "the coordinator's healthcheck to pass")
    mesh.start("thinker")
    mesh.start("talker", 3)  # docker compose up --scale talker=3
    mesh.start("code2wav")
    api = Api(mesh.url())
    try:
        api.wait_ready([p for instances in mesh.instances.values() for _, p in instances])
        wait_for(lambda: len(api.healthy("talker")) == 3, 60, "all three talker replicas to register")
        stages = api.stages()
        assert {name: len(replicas) for name, replicas in stages.items()} == {
            "thinker": 1,
            "talker": 3,
            "code2wav": 1,
        }
        talker_pids = {p.pid for _, p in mesh.instances["talker"]}
        assert {r["pid"] for r in stages["talker"]} == talker_pids
        assert len({r["id"] for r in stages["talker"]}) == 3, "scaled replicas need distinct ids"

        # The demo request, then enough at once that every talker replica gets some.
        body = api.ok({"prompt": "Hello from compose"}, timeout_s=60)
        out = body["outputs"]
        assert (
            "Hello from compose" in out["text"] and out["sample_rate"] == 24_000 and out["audio_wav_base64"]
        )
        with ThreadPoolExecutor(9) as pool:
            replies = list(
                pool.map(
                    lambda i: api.request(
                        {"prompt": f"request {i}"}, params={"max_tokens": 16}, timeout_s=60
                    ),
                    range(9),
                )
            )
        assert [r.status_code for r in replies] == [200] * 9, [
            r.text for r in replies if r.status_code != 200
        ]
        wait_for(
            lambda: all(r["processed"] > 0 for r in api.stages()["talker"]),
            10,
            "every talker replica to have processed a request",
        )

        # Every healthcheck passes while serving; a stage's fails once its health file is stale.
        checks = _all_healthchecks(mesh)
        assert len(checks) == 6 and set(checks.values()) == {0}, checks
        talker_local, talker = mesh.instances["talker"][0]
        stale = mesh.scratch / "stale-health"
        stale.touch()
        os.utime(stale, (time.time() - 60, time.time() - 60))
        talker_local.env["OMNI_MESH_HEALTH_FILE"] = str(stale)
        assert run_healthcheck(talker_local) != 0
        talker_local.env["OMNI_MESH_HEALTH_FILE"] = str(mesh.scratch / "no-such-file")
        assert run_healthcheck(talker_local) != 0

        # docker compose up --scale talker=2: one replica gets SIGTERM, drains, deregisters, exits 0.
        assert mesh.services.stop(talker, signal.SIGTERM) == 0
        assert "draining" in talker.log()
        wait_for(
            lambda: talker.pid not in {r["pid"] for r in api.stages()["talker"]}, 5, "the talker to leave"
        )
        assert len(api.healthy("talker")) == 2
        assert api.ok({"prompt": "after scaling down"}, params={"max_tokens": 16}, timeout_s=60)["outputs"][
            "text"
        ]
    finally:
        api.close()
    # docker compose down: SIGTERM to every container; each exits 0 and leaves nothing in /dev/shm.
    codes = mesh.services.stop_all(signal.SIGTERM)
    assert codes == dict.fromkeys(codes, 0), codes
    mesh.services.assert_no_segments()


@pytest.fixture
def store_compose(tmp_path: Path) -> Iterator[LocalCompose]:
    mesh = LocalCompose(STORE, tmp_path, {"coordinator": [5555, 8000], "mooncake-master": [50051, 9003]})
    with mesh.services:
        yield mesh


def test_mooncake_store_compose_services_run_locally(store_compose: LocalCompose) -> None:
    mesh = store_compose
    ((master_local, _),) = mesh.start("mooncake-master")
    ((coordinator_local, _),) = mesh.start("coordinator")
    wait_for(lambda: run_healthcheck(master_local) == 0, 30, "mooncake-master's healthcheck to pass")
    wait_for(lambda: run_healthcheck(coordinator_local) == 0, 60, "the coordinator's healthcheck to pass")
    for stage in DEMO_STAGES:
        mesh.start(stage)
    api = Api(mesh.url())
    try:
        api.wait_ready([p for instances in mesh.instances.values() for _, p in instances])
        out = api.ok({"prompt": "through the store"}, timeout_s=60)["outputs"]
        assert "through the store" in out["text"] and out["audio_wav_base64"]
        wait_for(
            lambda: api.stages()["thinker"][0]["connectors"]["store"]["puts"] >= 1,
            5,
            "the thinker's MooncakeStoreConnector to report its put",
        )
        checks = _all_healthchecks(mesh)
        assert len(checks) == 5 and set(checks.values()) == {0}, checks
    finally:
        api.close()
    master = mesh.instances["mooncake-master"][0][1]
    stages = [p for s in ["coordinator", *DEMO_STAGES] for _, p in mesh.instances[s]]
    codes = {p.name: mesh.services.stop(p, signal.SIGTERM) for p in reversed(stages)}
    assert codes == dict.fromkeys(codes, 0), codes
    mesh.services.stop(master, signal.SIGKILL)  # the master keeps no state worth a graceful exit
    mesh.services.assert_no_segments()
