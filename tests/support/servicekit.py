"""Run omni-mesh services one process each, the way compose runs them, for the compose, scaling and
multi-host tests.

`Services` starts `omni-mesh coordinator` / `omni-mesh stage` processes (or anything else), each with
its own log, optionally wrapped (`ip netns exec ...`), and stops them the way `docker compose stop`
does (SIGTERM, then SIGKILL past a grace period). `close()` kills whatever still runs and checks that
no process is left; `assert_no_segments()` checks that nothing they made is left in /dev/shm.

`compose_config` resolves a compose file with the real `docker-compose config`, and `localize` turns
one of its services into a local command line and environment: the image's /app is this repository,
each process gets its own /tmp (as each container has), and service-name addresses and the ports of
each service are mapped to 127.0.0.1 and free ports (see `localize`).
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from omni_mesh.connectors.shm.segments import (
    list_segments,
    owner_of,
    process_start_time,
    reap_orphaned_segments,
    shm_dir,
)
from omni_mesh.procinfo import descendants, dying_with_this_thread
from omni_mesh.security import ENV_KEYS_DIR, MeshKeys
from support.meshkit import wait_for

REPO = Path(__file__).resolve().parents[2]
COMPOSE = REPO / "compose"
BIN = Path(sys.executable).parent
OMNI_MESH = BIN / "omni-mesh"
IMAGE_WORKDIR = "/app"  # WORKDIR of services/Dockerfile: the repository's files live there
STOP_TIMEOUT_S = 40.0


# ====================================================================== processes


@dataclass
class Service:
    name: str
    process: subprocess.Popen
    log_path: Path
    start: int | None  # start time of the pid (with the pid: survives pid reuse)
    forks: bool = False  # the process is a wrapper (`unshare --fork`) and the service its one child
    children: dict[int, int] = field(default_factory=dict)

    @property
    def pid(self) -> int:
        return self.process.pid

    def running(self) -> bool:
        return self.process.poll() is None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def target(self) -> int:
        """The pid to signal: the process itself, or the one child of a forking wrapper (like the
        container's main process that `docker stop` signals). The wrapper exits with its status."""
        if not self.forks:
            return self.pid
        return wait_for(lambda: next(iter(sorted(descendants(self.pid))), None), 10, f"{self.name}'s process")

    def remember_children(self) -> None:
        for pid in descendants(self.pid):
            start = process_start_time(pid)
            if start is not None:
                self.children.setdefault(pid, start)

    def alive_pids(self) -> list[int]:
        pids = [pid for pid, start in self.children.items() if process_start_time(pid) == start]
        if self.start is not None and process_start_time(self.pid) == self.start and self.running():
            pids.append(self.pid)
        return pids


class Services:
    """The processes one test started. Use as a context manager: everything is killed on exit."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)
        self.services: list[Service] = []
        self.shm_before = set(list_segments())

    def __enter__(self) -> Services:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(
        self,
        name: str,
        argv: list[str],
        *,
        env: dict[str, str] | None = None,
        wrap: Iterable[str] = (),
        cwd: Path | None = None,
        forks: bool = False,
    ) -> Service:
        """Start one process (from the main thread: its parent-death signal follows this thread)."""
        log_path = self.directory / f"{name}.log"
        keys = {ENV_KEYS_DIR: str(test_keys_file())}  # every service of a test shares the mesh keys
        environment = {**os.environ, "PYTHONUNBUFFERED": "1", **keys, **(env or {})}
        with log_path.open("ab") as log:
            process = subprocess.Popen(
                dying_with_this_thread([*wrap, *argv]),
                cwd=cwd or self.directory,
                env=environment,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # signals reach it only from us
            )
        service = Service(name, process, log_path, process_start_time(process.pid), forks)
        self.services.append(service)
        return service

    def coordinator(
        self,
        topology: Path,
        *,
        port: int,
        control: str,
        name: str = "coordinator",
        extra: Iterable[str] = (),
        **kwargs: Any,
    ) -> Service:
        argv = [
            str(OMNI_MESH),
            "coordinator",
            str(topology),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--control",
            control,
            *extra,
        ]
        return self.start(name, argv, **kwargs)

    def stage(
        self,
        topology: Path,
        stage: str,
        *,
        coordinator: str,
        name: str,
        replica: str | None = None,
        **kwargs: Any,
    ) -> Service:
        argv = [str(OMNI_MESH), "stage", str(topology), "--stage", stage, "--coordinator", coordinator]
        if replica:
            argv += ["--replica", replica]
        return self.start(name, argv, **kwargs)

    def stop(
        self, service: Service, sig: signal.Signals = signal.SIGTERM, timeout_s: float = STOP_TIMEOUT_S
    ) -> int:
        """Signal `service` and wait for it to exit; fails (after killing it) past `timeout_s`."""
        service.remember_children()
        if service.running():
            os.kill(service.target(), sig)
        try:
            return service.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self._kill(service)
            raise AssertionError(
                f"{service.name} did not exit within {timeout_s} s of {sig.name}:\n{service.log()[-3000:]}"
            ) from None

    def stop_all(
        self, sig: signal.Signals = signal.SIGTERM, timeout_s: float = STOP_TIMEOUT_S
    ) -> dict[str, int]:
        """Like `docker compose stop`: signal every service still running (newest first), wait for all."""
        running = [s for s in reversed(self.services) if s.running()]
        for service in running:
            service.remember_children()
            os.kill(service.target(), sig)
        codes = {}
        deadline = time.monotonic() + timeout_s
        for service in running:
            try:
                codes[service.name] = service.process.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self._kill(service)
                raise AssertionError(
                    f"{service.name} did not exit within {timeout_s} s of {sig.name}:\n{service.log()[-3000:]}"
                ) from None
        return codes

    def _kill(self, service: Service) -> None:
        for pid in service.alive_pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            service.process.wait(10)

    def pids(self) -> set[int]:
        return {s.pid for s in self.services} | {pid for s in self.services for pid in s.children}

    def our_segments(self, directory: Path | None = None) -> list[str]:
        """Segments in `directory` (default: the shared-memory directory) made by one of our processes
        (and not there before we started)."""
        try:
            names = sorted(p.name for p in (directory or shm_dir()).iterdir())
        except FileNotFoundError:
            return []
        pids = self.pids()
        return [
            name
            for name in names
            if (owner := owner_of(name)) is not None and owner.pid in pids and name not in self.shm_before
        ]

    def assert_no_segments(self, directory: Path | None = None) -> None:
        leftovers = self.our_segments(directory)
        assert not leftovers, f"shared-memory segments left in {directory or shm_dir()}: {leftovers}"

    def close(self) -> None:
        """Kill what still runs, check nothing is left, and reap what killed processes left in /dev/shm."""
        for service in self.services:
            service.remember_children()
            if service.running() or service.alive_pids():
                self._kill(service)
        wait_for(lambda: not any(s.alive_pids() for s in self.services), 10, "every started process to exit")
        for pid in self.pids():
            reap_orphaned_segments(pid=pid)


# ====================================================================== the coordinator's REST API


class Api:
    """The coordinator's REST API. `call` runs each HTTP call (default: in this thread)."""

    def __init__(self, url: str, *, call: Callable[..., Any] | None = None) -> None:
        self.url = url
        self.client = httpx.Client(base_url=url, timeout=60.0)
        self._call = call or (lambda fn, *args, **kwargs: fn(*args, **kwargs))

    def close(self) -> None:
        self.client.close()

    def post(self, body: dict, timeout_s: float) -> httpx.Response:
        return self._call(self.client.post, "/v1/requests", json=body, timeout=timeout_s)

    def request(self, inputs: Any, *, params: dict | None = None, timeout_s: float = 20.0) -> httpx.Response:
        body = {"inputs": inputs, "params": params or {}, "timeout_s": timeout_s}
        return self.post(body, timeout_s + 30)

    def ok(self, inputs: Any, **kwargs: Any) -> dict:
        response = self.request(inputs, **kwargs)
        assert response.status_code == 200, (response.status_code, response.text)
        return response.json()

    def get(self, path: str) -> httpx.Response:
        return self._call(self.client.get, path, timeout=10)

    def stages(self) -> dict[str, list[dict]]:
        response = self.get("/v1/stages")
        assert response.status_code == 200, response.text
        return {stage["name"]: stage["replicas"] for stage in response.json()["stages"]}

    def healthy(self, stage: str) -> list[dict]:
        return [r for r in self.stages().get(stage, []) if r["health"] == "healthy"]

    def ready(self) -> httpx.Response:
        return self.get("/ready")

    def wait_ready(self, services: Iterable[Service], timeout_s: float = 90.0) -> None:
        """Poll /ready until 200; fail at once (with its log) if one of `services` exits meanwhile."""
        services = list(services)

        def ready() -> bool:
            for service in services:
                if not service.running():
                    raise AssertionError(
                        f"{service.name} exited with {service.process.returncode}:\n{service.log()[-4000:]}"
                    )
            with contextlib.suppress(httpx.HTTPError):
                return self.ready().status_code == 200
            return False

        wait_for(ready, timeout_s, f"{self.url}/ready", interval_s=0.2)


# ====================================================================== compose files as local processes


def docker_compose() -> str:
    found = shutil.which("docker-compose")
    if found is None:
        pytest.fail(
            "docker-compose is missing: `make test` installs it (or run "
            "`apt-get install -y --no-install-recommends docker-compose`)"
        )
    return found


@functools.cache
def test_keys_file() -> Path:
    """One mesh key pair for the whole test session: the file compose mounts as its `mesh_keys` secret."""
    directory = Path(tempfile.mkdtemp(prefix="omni-mesh-test-keys-"))
    atexit.register(shutil.rmtree, directory, True)  # a secret key: not left in /tmp after the run
    return MeshKeys.generate().write(directory)


def compose_config(path: Path, env: dict[str, str] | None = None) -> dict:
    """`docker-compose -f FILE config` run from the file's directory, parsed: the resolved file."""
    result = subprocess.run(
        [docker_compose(), "-f", path.name, "config"],
        cwd=path.parent,
        env={**os.environ, "OMNI_MESH_KEYS_FILE": str(test_keys_file()), **(env or {})},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, f"docker-compose -f {path.name} config failed:\n{result.stderr}"
    return yaml.safe_load(result.stdout)


@dataclass
class LocalService:
    name: str
    argv: list[str]
    env: dict[str, str]
    healthcheck: list[str] | None


_EXECUTABLES = {
    "omni-mesh": str(OMNI_MESH),
    "mooncake_master": str(BIN / "mooncake_master"),
    "python": sys.executable,
}


def localize(
    config: dict,
    service: str,
    *,
    scratch: Path,
    instance: str | None = None,
    ports: dict[str, dict[int, int]] | None = None,
) -> LocalService:
    """One service of a resolved compose file as a local process.

    - `/app/...` (the image's WORKDIR) is this repository; `/tmp/...` is `scratch/INSTANCE/...`.
    - `ports` maps each service's container ports to local ones: `{"coordinator": {5555: 41234}}`.
      In the service's own strings, `0.0.0.0:P` becomes `127.0.0.1:NEW` and a bare `P` becomes NEW; in
      every service's strings, `SERVICE:P` becomes `127.0.0.1:NEW`. Without `ports`, nothing changes.
    - A topology (OMNI_MESH_TOPOLOGY) that names `SERVICE:P` is copied into `scratch`, translated.
    - `omni-mesh`, `mooncake_master` and `python` are the ones of this virtual environment.
    """
    spec = config["services"][service]
    instance = instance or service
    ports = ports or {}
    tmp = scratch / instance / "tmp"
    tmp.mkdir(parents=True, exist_ok=True)

    secrets = {name: spec_["file"] for name, spec_ in (config.get("secrets") or {}).items() if "file" in spec_}

    def translate(text: str) -> str:
        # One pass: the repository (or a secret's file) may itself live under /tmp (a CI clone, a test's
        # keys), and must not be rewritten. Secrets are mounted at /run/secrets/NAME: here they are the
        # files compose would mount.
        roots = {"app": str(REPO), "tmp": str(tmp)}

        def local(match: re.Match) -> str:
            if match.group(1):
                return secrets.get(match.group(1), match.group(0))
            return roots[match.group(2)]

        text = re.sub(r"/run/secrets/([\w.-]+)|(?<![\w/])/(app|tmp)(?=/|$)", local, text)
        for other, mapping in ports.items():
            for port, new in mapping.items():
                text = re.sub(rf"(?<![\w.-]){re.escape(other)}:{port}\b", f"127.0.0.1:{new}", text)
        for port, new in ports.get(service, {}).items():
            text = re.sub(rf"\b0\.0\.0\.0:{port}\b", f"127.0.0.1:{new}", text)
            text = re.sub(rf"(?<![\d.]){port}(?![\d.])", str(new), text)
        return text

    def executable(argv: list[str]) -> list[str]:
        return [_EXECUTABLES.get(argv[0], argv[0]), *argv[1:]] if argv else argv

    command = spec.get("command")
    assert isinstance(command, list) and command, f"service {service}: command must be a list (exec form)"
    env = {key: translate(str(value)) for key, value in (spec.get("environment") or {}).items()}
    topology = env.get("OMNI_MESH_TOPOLOGY")
    if topology:
        text = Path(topology).read_text()
        translated = translate(text)
        if translated != text:
            copy = scratch / instance / Path(topology).name
            copy.write_text(translated)
            env["OMNI_MESH_TOPOLOGY"] = str(copy)
    healthcheck = None
    test = (spec.get("healthcheck") or {}).get("test")
    if test:
        kind, *rest = test
        argv = rest if kind == "CMD" else ["sh", "-c", " ".join(rest)]
        healthcheck = executable([translate(a) for a in argv])
    return LocalService(instance, executable([translate(a) for a in command]), env, healthcheck)


def run_healthcheck(service: LocalService, timeout_s: float = 10.0) -> int:
    """Run a service's healthcheck command locally, with the service's environment; its exit status."""
    assert service.healthcheck, f"{service.name} has no healthcheck"
    result = subprocess.run(
        service.healthcheck,
        env={**os.environ, **service.env},
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    return result.returncode
