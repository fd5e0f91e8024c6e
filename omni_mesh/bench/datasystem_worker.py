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
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass

DSCLI = os.path.join(os.path.dirname(sys.executable), "dscli")


def free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


@dataclass
class Worker:
    host: str
    port: int
    env: dict

    @property
    def config(self) -> dict:
        return {"host": self.host, "port": self.port}

    def exists(self, keys: list[str]) -> list[bool]:
        from yr.datasystem import KVClient

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
        try:
            with open(f"/proc/{pid}/stat") as stat:
                if stat.read().split(") ", 1)[1].startswith("Z"):
                    return
        except (FileNotFoundError, ProcessLookupError):
            return
        time.sleep(0.1)
    os.kill(pid, signal.SIGKILL)


@contextlib.contextmanager
def running_worker(shared_memory_mb: int = 1024, extra_args: tuple[str, ...] = ()) -> Iterator[Worker]:
    """Start a worker, yield it, stop it (on every path). `extra_args` go to `dscli start` as they are."""
    home = tempfile.mkdtemp(prefix="omy-")  # short: the worker's unix socket path must stay under 80 chars
    port, metastore = free_ports(2)
    address = f"127.0.0.1:{port}"
    env = {**os.environ, "DATASYSTEM_CLIENT_LOG_DIR": os.path.join(home, "client-logs")}
    saved = os.environ.get("DATASYSTEM_CLIENT_LOG_DIR")
    os.environ["DATASYSTEM_CLIENT_LOG_DIR"] = env["DATASYSTEM_CLIENT_LOG_DIR"]
    argv = [DSCLI, "start", "-t", "60", "-d", home, "-w", "--worker_address", address]
    argv += ["--metastore_address", f"127.0.0.1:{metastore}", "--start_metastore_service", "true"]
    argv += ["--shared_memory_size_mb", str(shared_memory_mb), *extra_args]
    pid = None
    try:
        started = subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env)
        found = re.search(r"PID: (\d+)", started.stdout)
        pid = int(found.group(1)) if found else None
        if started.returncode != 0 or "success" not in started.stdout:
            raise RuntimeError(f"dscli did not start a worker on {address}: {started.stdout}{started.stderr}")
        yield Worker("127.0.0.1", port, env)
    finally:
        if pid is not None:
            _stop(pid)
        else:  # started but not reported: dscli finds it by its address
            subprocess.run([DSCLI, "stop", "-w", address], capture_output=True, timeout=60, env=env)
        if saved is None:
            os.environ.pop("DATASYSTEM_CLIENT_LOG_DIR", None)
        else:
            os.environ["DATASYSTEM_CLIENT_LOG_DIR"] = saved
        shutil.rmtree(home, ignore_errors=True)
