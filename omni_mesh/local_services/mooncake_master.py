"""A `mooncake_master` on free loopback ports, for the tests, the benchmarks and local runs.

    with MooncakeMaster() as master:
        config = {"master": master.address, ...}
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import socket
import subprocess
import threading
import time

from omni_mesh.connectors.errors import ConnectorError
from omni_mesh.connectors.mooncake_store import INSTALL_HINT
from omni_mesh.ports import free_ports, taken_since

START_ATTEMPTS = 3  # the ports are picked before the master binds them: another process may take one


def master_binary() -> str:
    """Path of the `mooncake_master` executable shipped inside the mooncake wheel (found without importing it)."""
    spec = importlib.util.find_spec("mooncake")
    if spec is None or not spec.submodule_search_locations:
        raise ConnectorError(f"mooncake_master: the mooncake library is not available; {INSTALL_HINT}")
    path = os.path.join(next(iter(spec.submodule_search_locations)), "mooncake_master")
    if not os.access(path, os.X_OK):
        raise ConnectorError(f"mooncake_master: {path} is missing or not executable; reinstall mooncake")
    return path


class MooncakeMaster:
    """A `mooncake_master` process (module docstring); `address` is its HOST:RPC_PORT once started."""

    def __init__(
        self, *, host: str = "127.0.0.1", extra_args: tuple[str, ...] = (), log_path: str | None = None
    ):
        self.host = host
        self.extra_args = extra_args
        self.log_path = log_path or os.devnull
        self.process: subprocess.Popen | None = None
        self.address = ""

    def start(self, timeout_s: float = 10.0) -> MooncakeMaster:
        binary = master_binary()
        for _attempt in range(START_ATTEMPTS):
            ports = free_ports(2, self.host)
            argv = [
                binary,
                f"--rpc_address={self.host}",
                f"--rpc_port={ports[0]}",
                f"--metrics_host={self.host}",
                f"--metrics_port={ports[1]}",
                *self.extra_args,
            ]
            with open(self.log_path, "ab") as log:
                self.process = subprocess.Popen(argv, stdout=log, stderr=log, stdin=subprocess.DEVNULL)
            if self._wait_ready(ports[0], timeout_s):
                self.address = f"{self.host}:{ports[0]}"
                return self
            self.stop()
            if not taken_since(self.host, ports):
                break  # the master itself failed: starting it again would fail the same way
        raise ConnectorError(f"mooncake_master did not start on {self.host} (log: {self.log_path})")

    def _wait_ready(self, port: int, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process is None or self.process.poll() is not None:
                return False
            with contextlib.suppress(OSError):
                socket.create_connection((self.host, port), timeout=0.2).close()
                # A master that could not bind exits: whoever answered then was another process.
                return self.process.poll() is None
            # Nothing to wait on but the port itself; the master is up in about 0.1 s.
            threading.Event().wait(0.02)
        return False

    def stop(self) -> None:
        process, self.process = self.process, None
        if process is not None and process.poll() is None:
            process.kill()  # holds no state worth a graceful exit, which takes it ~2 s
        if process is not None:
            process.wait()

    def __enter__(self) -> MooncakeMaster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
