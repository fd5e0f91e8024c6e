"""A throwaway openYuanrong datasystem worker: `dscli start` on free loopback ports, in a temp dir.

For the test suite and for `omni-mesh bench connector --connector YuanrongConnector --start-worker`:

    with running_worker() as worker:
        connector = create_connector("YuanrongConnector", worker.config)

The worker uses dscli's built-in metastore (no etcd) and takes ~6 s to start. While it runs, the
datasystem client logs of this process and of every process it starts go to the worker's temp dir
(DATASYSTEM_CLIENT_LOG_DIR). Leaving the block stops the worker and removes the dir.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass

from omni_mesh.connectors import backends
from omni_mesh.ports import free_ports, taken_since
from omni_mesh.procinfo import stat_fields

DSCLI = os.path.join(os.path.dirname(sys.executable), "dscli")
START_ATTEMPTS = 3  # the ports are picked before the worker binds them: another process may take one


@dataclass
class Worker:
    host: str
    port: int
    env: dict

    @property
    def config(self) -> dict:
        return {"host": self.host, "port": self.port}

    def exists(self, keys: list[str]) -> list[bool]:
        KVClient = backends.load("yr.datasystem", "datasystem_worker").KVClient  # noqa: N806

        client = KVClient(self.host, self.port, connect_timeout_ms=3000)
        client.init()
        return client.exist(keys)


def _stop(pid: int) -> None:
    """SIGTERM the daemonized worker and wait until it is gone (a zombie counts as gone)."""
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        fields = stat_fields(pid)
        if fields is None or fields[0] == "Z":
            return
        time.sleep(0.1)
    os.kill(pid, signal.SIGKILL)


@contextlib.contextmanager
def running_worker(shared_memory_mb: int = 1024, extra_args: tuple[str, ...] = ()) -> Iterator[Worker]:
    """Start a worker, yield it, stop it (on every path). `extra_args` go to `dscli start` as they are."""
    home = tempfile.mkdtemp(prefix="omy-")  # short: the worker's unix socket path must stay under 80 chars
    env = {**os.environ, "DATASYSTEM_CLIENT_LOG_DIR": os.path.join(home, "client-logs")}
    saved = os.environ.get("DATASYSTEM_CLIENT_LOG_DIR")
    os.environ["DATASYSTEM_CLIENT_LOG_DIR"] = env["DATASYSTEM_CLIENT_LOG_DIR"]
    try:
        for attempt in range(1, START_ATTEMPTS + 1):
            ports = free_ports(2)
            try:
                pid = _start(home, ports, shared_memory_mb, extra_args, env)
                break
            except RuntimeError:
                if attempt == START_ATTEMPTS or not taken_since("127.0.0.1", ports):
                    raise
        try:
            yield Worker("127.0.0.1", ports[0], env)
        finally:
            _stop_worker(pid, f"127.0.0.1:{ports[0]}", env)
    finally:
        if saved is None:
            os.environ.pop("DATASYSTEM_CLIENT_LOG_DIR", None)
        else:
            os.environ["DATASYSTEM_CLIENT_LOG_DIR"] = saved
        shutil.rmtree(home, ignore_errors=True)


def _start(
    home: str, ports: list[int], shared_memory_mb: int, extra_args: tuple[str, ...], env: dict
) -> int | None:
    """`dscli start` a daemonized worker on `ports` (worker, metastore); its pid if dscli said it. On
    failure nothing of it is left running and RuntimeError carries dscli's output."""
    address = f"127.0.0.1:{ports[0]}"
    argv = [DSCLI, "start", "-t", "60", "-d", home, "-w", "--worker_address", address]
    argv += ["--metastore_address", f"127.0.0.1:{ports[1]}", "--start_metastore_service", "true"]
    argv += ["--shared_memory_size_mb", str(shared_memory_mb), *extra_args]
    pid = None
    try:
        started = subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env)
        found = re.search(r"PID: (\d+)", started.stdout)
        pid = int(found.group(1)) if found else None
        if started.returncode != 0 or "success" not in started.stdout:
            raise RuntimeError(f"dscli did not start a worker on {address}: {started.stdout}{started.stderr}")
        return pid
    except BaseException:
        _stop_worker(pid, address, env)
        raise


def _stop_worker(pid: int | None, address: str, env: dict) -> None:
    if pid is not None:
        _stop(pid)
    else:  # started but not reported: dscli finds it by its address
        subprocess.run([DSCLI, "stop", "-w", address], capture_output=True, timeout=60, env=env)
