"""A mesh started with `omni-mesh up` for one benchmark run, in a process of its own.

The launcher's output goes to a temporary log, not the terminal: the benchmark reads it to tell
which control plane it measured (the coordinator logs "CURVE" or "NO authentication"), and shows
its tail when the mesh does not come up. The launcher's children (coordinator, replicas) are found
in /proc, to signal them or to count the CPU time they spend.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

from omni_mesh.defaults import ENV_INSECURE as ENV_INSECURE
from omni_mesh.ports import free_port, taken_since
from omni_mesh.procinfo import children_of

READY_TIMEOUT_S = 60.0
PORT_ATTEMPTS = 3  # the REST port is picked before `up` binds it: another process may take it first


@dataclass
class RunningMesh:
    url: str
    process: subprocess.Popen
    log_path: Path
    exit_status: int | None = None  # set once the launcher has stopped

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def processes(self) -> set[int]:
        """The launcher's children now: the coordinator and the stage replicas."""
        return children_of(self.process.pid)

    def control_plane(self) -> str:
        """"CURVE" or "insecure" as the coordinator announced it, "unknown" if it has not (yet)."""
        for line in self.log().splitlines():
            if "coordinator control plane on" in line:
                return "CURVE" if "(CURVE" in line else "insecure" if "NO authentication" in line else "unknown"
        return "unknown"


def launcher_environment(insecure: bool | None) -> dict[str, str]:
    """This environment with CURVE forced off (True), forced on (False), or as it is (None)."""
    env = dict(os.environ)
    if insecure is True:
        env[ENV_INSECURE] = "1"
    elif insecure is False:
        env.pop(ENV_INSECURE, None)
    return env


@contextlib.contextmanager
def running_mesh(
    topology: str | os.PathLike, *, insecure: bool | None = None, extra: list[str] | None = None,
    ready_timeout_s: float = READY_TIMEOUT_S,
) -> Iterator[RunningMesh]:
    """Run `omni-mesh up TOPOLOGY [extra flags]` for the block, ready; stop it with SIGINT (Ctrl-C) after.
    `ready_timeout_s`: more for stages that load models."""
    for attempt in range(1, PORT_ATTEMPTS + 1):
        port = free_port()
        with tempfile.NamedTemporaryFile("w+b", prefix="omni-mesh-up-", suffix=".log", delete=False) as log_file:
            process = subprocess.Popen(
                [sys.executable, "-m", "omni_mesh", "up", str(topology), "--port", str(port), *(extra or [])],
                stdout=log_file, stderr=subprocess.STDOUT, env=launcher_environment(insecure),
            )
        mesh = RunningMesh(f"http://127.0.0.1:{port}", process, Path(log_file.name))
        try:
            _wait_ready(mesh, str(topology), ready_timeout_s)
            break
        except BaseException as exc:
            mesh.exit_status = stop(process)
            # The port was free when picked; if `up` refused it because someone took it since, pick again.
            if not isinstance(exc, RuntimeError) or attempt == PORT_ATTEMPTS or not taken_since("127.0.0.1", [port]):
                raise
            mesh.log_path.unlink(missing_ok=True)
    try:
        yield mesh
    finally:
        mesh.exit_status = stop(process)
        if mesh.exit_status == 0:
            mesh.log_path.unlink(missing_ok=True)


def stop(process: subprocess.Popen, timeout_s: float = 45.0) -> int:
    """SIGINT, as Ctrl-C would (an orderly stop that reaps /dev/shm); SIGKILL if that hangs."""
    process.send_signal(signal.SIGINT)
    try:
        return process.wait(timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
        return -signal.SIGKILL


def _wait_ready(mesh: RunningMesh, topology: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if mesh.process.poll() is not None:
            raise RuntimeError(f"omni-mesh up {topology} exited with status {mesh.process.returncode}:\n{_tail(mesh)}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{mesh.url}/ready", timeout=1.0).status_code == 200:
                return
        time.sleep(0.2)
    raise RuntimeError(f"omni-mesh up {topology} was not ready within {timeout_s:.0f} s:\n{_tail(mesh)}")


def _tail(mesh: RunningMesh, lines: int = 20) -> str:
    return "\n".join(mesh.log().splitlines()[-lines:])
