"""`docker compose` for real: the image built from services/Dockerfile, the demo brought up, the
README's request answered with a WAV, the talker scaled to 3 and back to 1 under load with no failed
request, and `down` leaving no container, network, mount or /dev/shm segment behind.

Loopback only. The compose file is the host-network variant of compose/docker-compose.yml, made by the
same exporter (`omni-mesh export compose compose/omni-demo.yaml --network host ...`): every service on
the host's network, listening on 127.0.0.1, each on its own port. The engine docker_engine.py starts
has no bridge network at all. Compose is v2 (`docker compose`) where present, else v1 (`docker-compose`).

Skipped, with the reason, only where no engine can run at all (not root, no cgroups). Cold (no cache:
the base image by mmdebstrap, torch and the dependencies) it takes about four minutes; warm, about one.
"""

from __future__ import annotations

import base64
import io
import os
import shutil
import subprocess
import threading
import time
import wave
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
from support import servicekit
from support.docker_engine import (
    Engine,
    base_image,
    docker_engine,
    engine_unavailable,
    mounts_of,
    torch_index,
)
from support.meshkit import wait_for
from support.servicekit import COMPOSE, OMNI_MESH, docker_compose

from omni_mesh.connectors.shm.segments import list_segments, owner_of
from omni_mesh.ports import free_port

pytestmark = pytest.mark.timeout(1800)  # a cold run builds everything: minutes, not the suite's 300 s

DEMO = COMPOSE / "omni-demo.yaml"
IMAGE = "omni-mesh:test"  # not omni-mesh:latest: an engine that was already running may hold the user's
IMAGE_UID = 10001  # the image's user: the mounted keys file must be readable by it
README_REQUEST = {"inputs": {"prompt": "Hello, omni-mesh!"}, "timeout_s": 30}


@dataclass
class Compose:
    """One compose project on one engine."""

    engine: Engine
    file: Path
    project: str
    env: dict[str, str]
    command: list[str]

    def __call__(self, *args: str, timeout_s: float = 300, check: bool = True) -> subprocess.CompletedProcess:
        argv = [*self.command, "-f", str(self.file), "-p", self.project, *args]
        result = subprocess.run(argv, env=self.env, capture_output=True, text=True, timeout=timeout_s)
        if check and result.returncode != 0:
            raise AssertionError(
                f"{' '.join(argv)} failed ({result.returncode}):\n{result.stderr[-4000:]}\n{self.logs()}"
            )
        return result

    def logs(self) -> str:
        return self("logs", "--no-color", "--tail", "40", check=False, timeout_s=60).stdout[-8000:]

    def containers(self, service: str | None = None, *, stopped: bool = False) -> list[str]:
        filters = ["--filter", f"label=com.docker.compose.project={self.project}"]
        if service:
            filters += ["--filter", f"label=com.docker.compose.service={service}"]
        return self.engine.docker("ps", "-q", "--no-trunc", *(["-a"] if stopped else []), *filters).stdout.split()

    def networks(self) -> list[str]:
        label = f"label=com.docker.compose.project={self.project}"
        return self.engine.docker("network", "ls", "-q", "--filter", label).stdout.split()

    def pid(self, container: str) -> int:
        return int(self.engine.docker("inspect", "-f", "{{.State.Pid}}", container).stdout)


@dataclass
class Demo:
    compose: Compose
    url: str
    timings: dict[str, float] = field(default_factory=dict)


def compose_command(engine: Engine) -> list[str]:
    v2 = subprocess.run(["docker", "compose", "version"], env=engine.env, capture_output=True, timeout=30)
    return ["docker", "compose"] if v2.returncode == 0 else [docker_compose()]


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Demo]:
    reason = engine_unavailable()
    if reason:
        pytest.skip(f"no Docker engine can run here: {reason}")
    scratch = tmp_path_factory.mktemp("docker-compose")
    logs = scratch / "logs"
    started = time.monotonic()
    with docker_engine(logs) as engine, torch_index() as torch:
        timings = {"engine": time.monotonic() - started}
        base = base_image(engine, logs)
        timings["base image"] = time.monotonic() - started - sum(timings.values())
        http, control = free_port(), free_port()
        file = scratch / "docker-compose.yml"
        export = [str(OMNI_MESH), "export", "compose", str(DEMO), "--network", "host"]
        export += ["--http-port", str(http), "--control-port", str(control), "-o", str(file)]
        subprocess.run(export, check=True, capture_output=True, timeout=60)
        keys = scratch / "keys" / "mesh.key_secret"
        keys.parent.mkdir()
        shutil.copy2(servicekit.test_keys_file(), keys)
        os.chown(keys, IMAGE_UID, IMAGE_UID)  # compose mounts a secret file as it is (mode 0600 stays)
        env = {
            **engine.env,
            "OMNI_MESH_KEYS_FILE": str(keys),
            "OMNI_MESH_IMAGE": IMAGE,
            "PYTHON_IMAGE": base,
            "TORCH_INDEX_URL": torch.index_url,
            **({"TORCH_VERSION": torch.version} if torch.version else {}),
        }
        compose = Compose(engine, file, f"omnimeshtest{os.getpid()}", env, compose_command(engine))
        try:
            compose("build", "coordinator", timeout_s=1500)  # one image serves every service
            timings["image"] = time.monotonic() - started - sum(timings.values())
            yield Demo(compose, f"http://127.0.0.1:{http}", timings)
        finally:
            compose("down", "--timeout", "60", check=False, timeout_s=180)
            print(f"\ndocker compose test timings (s): {', '.join(f'{k} {v:.0f}' for k, v in timings.items())}")


class Load:
    """Clients sending requests back to back until stopped; every answer that is not 200 is kept."""

    def __init__(self, url: str, clients: int) -> None:
        self.url = url
        self.ok = 0
        self.failures: list[str] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._client, args=(i,), daemon=True) for i in range(clients)]

    def __enter__(self) -> Load:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(60)

    def served(self) -> int:
        with self._lock:
            return self.ok

    def _client(self, index: int) -> None:
        with httpx.Client(base_url=self.url, timeout=60) as client:
            n = 0
            while not self._stop.is_set():
                n += 1
                body = {"inputs": {"prompt": f"load {index}-{n}"}, "params": {"max_tokens": 16}, "timeout_s": 30}
                try:
                    response = client.post("/v1/requests", json=body)
                    failure = None if response.status_code == 200 else f"{response.status_code} {response.text[:300]}"
                except httpx.HTTPError as exc:
                    failure = f"{type(exc).__name__}: {exc}"
                with self._lock:
                    if failure is None:
                        self.ok += 1
                    else:
                        self.failures.append(failure)


def _stages(url: str) -> dict[str, list[dict]]:
    response = httpx.get(f"{url}/v1/stages", timeout=10)
    response.raise_for_status()
    return {stage["name"]: stage["replicas"] for stage in response.json()["stages"]}


def _healthy(url: str, stage: str) -> int:
    return sum(r["health"] == "healthy" for r in _stages(url).get(stage, []))


def _ready(demo: Demo) -> bool:
    exited = demo.compose.containers(stopped=True)
    running = set(demo.compose.containers())
    if any(c not in running for c in exited):
        raise AssertionError(f"a container exited:\n{demo.compose.logs()}")
    try:
        return httpx.get(f"{demo.url}/ready", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def _check_wav(outputs: dict) -> None:
    assert "Hello, omni-mesh!" in outputs["text"], outputs["text"]
    audio = base64.b64decode(outputs["audio_wav_base64"])
    with wave.open(io.BytesIO(audio)) as wav:
        assert (wav.getframerate(), wav.getnchannels(), wav.getsampwidth()) == (24_000, 1, 2)
        assert wav.getnframes() > 0


def _pid_namespaces(compose: Compose) -> set[int]:
    """The PID namespaces of the project's running containers (segment names carry their maker's)."""
    return {os.stat(f"/proc/{compose.pid(c)}/ns/pid").st_ino for c in compose.containers()}


def _mesh_segments(compose: Compose) -> tuple[list[str], list[str]]:
    """The segments in the mesh's shared /dev/shm (the coordinator's IPC namespace), split by whether
    their maker's PID namespace is a running container's: (live, left behind by what went away)."""
    coordinator = compose.containers("coordinator")[0]
    shm = Path(f"/proc/{compose.pid(coordinator)}/root/dev/shm")
    running = _pid_namespaces(compose)
    owned = [(name, owner) for name in os.listdir(shm) if (owner := owner_of(name)) is not None]
    return [n for n, o in owned if o.pidns in running], [n for n, o in owned if o.pidns not in running]


def test_demo_serves_scales_under_load_and_leaves_nothing(demo: Demo) -> None:
    compose, url = demo.compose, demo.url
    ours: set[int] = set()  # PID namespaces of every container the test saw: its segments carry them
    started = time.monotonic()
    compose("up", "-d")
    wait_for(lambda: _ready(demo), 120, f"{url}/ready", interval_s=0.5)
    demo.timings["up to /ready"] = time.monotonic() - started
    ours |= _pid_namespaces(compose)

    # The README's request: its text, and a 24 kHz mono 16-bit WAV.
    reply = httpx.post(f"{url}/v1/requests", json=README_REQUEST, timeout=60)
    assert reply.status_code == 200, reply.text
    _check_wav(reply.json()["outputs"])

    # --scale talker=3, then back to 1, while clients keep sending: not one request may fail.
    started = time.monotonic()
    with Load(url, clients=4) as load:
        compose("up", "-d", "--scale", "talker=3")
        wait_for(lambda: _healthy(url, "talker") == 3, 90, "three healthy talker replicas")
        ours |= _pid_namespaces(compose)
        mark = load.served()
        wait_for(lambda: load.served() >= mark + 30, 60, "requests served by three talkers")
        compose("up", "-d", "--scale", "talker=1", timeout_s=180)  # SIGTERM: the two drain, then exit
        wait_for(lambda: len(_stages(url)["talker"]) == 1, 60, "one talker replica left in /v1/stages")
        mark = load.served()
        wait_for(lambda: load.served() >= mark + 30, 60, "requests served after scaling down")
    demo.timings["scale 1->3->1 under load"] = time.monotonic() - started
    assert not load.failures, f"{len(load.failures)} failed of {load.ok + len(load.failures)}: {load.failures[:5]}"
    assert load.ok >= 60
    assert len(compose.containers("talker")) == 1
    live, left = _mesh_segments(compose)
    assert live, "no segment of the running producers in the shared /dev/shm: the check looks in the wrong place"
    assert left == [], "the replicas scaled away left shared memory behind"

    # down: no container, network, mount or segment of the mesh is left.
    containers = compose.containers(stopped=True)
    started = time.monotonic()
    compose("down", "--timeout", "60")
    demo.timings["down"] = time.monotonic() - started
    assert compose.containers(stopped=True) == []
    assert compose.networks() == []
    assert mounts_of(containers) == [], "a container's /dev/shm or root is still mounted"
    # The mesh's IPC namespace went with its containers; nothing of theirs may sit in the host's either
    # (other processes' segments there are not ours to judge).
    leaked = [name for name in list_segments() if (owner := owner_of(name)) and owner.pidns in ours]
    assert leaked == [], "segments of the mesh in the host's /dev/shm"
