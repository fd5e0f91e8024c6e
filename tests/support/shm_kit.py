"""SharedMemoryConnector test support: a consumer in a separate process, and this run's segments.

`ShmPeer` runs tests/support/shm_consumer.py and drives it through its stdin and stdout (metadata reaches
it as msgpack, as over the control plane); `our_segments` lists the segments this process or those
peers made, so a test can check it leaves none behind.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import msgpack

from omni_mesh import codec
from omni_mesh.connectors import create_connector
from omni_mesh.connectors.shared_memory import SharedMemoryConnector
from omni_mesh.connectors.shm.segments import list_segments, owner_of, shm_dir

HELPER = Path(__file__).parent / "shm_consumer.py"
LENGTH = struct.Struct("<I")
SPAWNED: set[int] = set()  # pids of the helper processes this test run started


def our_segments() -> dict[str, int]:
    """Segments made by this process or the helpers it started, with their sizes in bytes."""
    pids = {os.getpid()} | SPAWNED
    sizes = {}
    for name in list_segments():
        owner = owner_of(name)
        if owner is not None and owner.pid in pids:
            with contextlib.suppress(FileNotFoundError):
                sizes[name] = (shm_dir() / name).stat().st_size
    return sizes


def connector(config: dict | None = None) -> SharedMemoryConnector:
    made = create_connector("SharedMemoryConnector", config)
    assert isinstance(made, SharedMemoryConnector)
    return made


class ShmPeer:
    """A helper process running tests/support/shm_consumer.py, driven through its stdin and stdout."""

    def __init__(self, config: dict | None = None, *, env: dict[str, str] | None = None) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(HELPER), msgpack.packb(config or {}).hex()],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env={**os.environ, **env} if env else None,
        )
        SPAWNED.add(self.proc.pid)
        self.pid = self._receive(timeout=120)["pid"]
        assert self.pid == self.proc.pid

    def call(self, op: str, **kwargs: Any) -> dict:
        data = msgpack.packb({"op": op, **kwargs}, use_bin_type=True)
        assert self.proc.stdin is not None
        self.proc.stdin.write(LENGTH.pack(len(data)) + data)
        self.proc.stdin.flush()
        return self._receive()

    def get(
        self, key: str, metadata: dict | None, *, edge: tuple[str, str] = ("a", "b"), **kwargs: Any
    ) -> Any:
        """The payload the helper got (decoded from its re-encoding), or None; raises on its errors."""
        reply = self.call(
            "get", from_stage=edge[0], to_stage=edge[1], get_key=key, metadata=metadata, **kwargs
        )
        if "error" in reply:
            raise RuntimeError(f"{reply['error']}: {reply['message']}")
        return None if reply.get("none") else codec.decode(reply["frame"])

    def _receive(self, timeout: float = 60) -> dict:
        deadline = time.monotonic() + timeout
        head = self._read(LENGTH.size, deadline)
        return msgpack.unpackb(self._read(LENGTH.unpack(head)[0], deadline), raw=False, strict_map_key=False)

    def _read(self, count: int, deadline: float) -> bytes:
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        chunks = []
        while count:
            ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                raise TimeoutError("the helper process did not answer")
            chunk = os.read(fd, count)
            if not chunk:
                raise EOFError(f"the helper process exited ({self.proc.poll()})")
            chunks.append(chunk)
            count -= len(chunk)
        return b"".join(chunks)

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=30)
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None and not pipe.closed:
                pipe.close()

    def stop(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            self.proc.wait(timeout=30)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
