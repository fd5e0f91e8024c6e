"""What the two Mooncake connectors share: the lazy backend import, the `host: auto` rule, the fast
master/metadata-server probes and the registered memory pool that payload frames are laid into (the
`mooncake_master` launcher for tests and benchmarks is omni_mesh.testing.mooncake_master).

`resolve_host` is the `host: auto` rule every connector shares (omni_mesh.connectors._addresses):
Mooncake binds and advertises the one address it returns.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import importlib
import importlib.util
import mmap
import os
import socket
import sys
import threading
import time
import urllib.parse
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import numpy as np

from omni_mesh import codec
from omni_mesh.connectors._addresses import resolve_host as resolve_host  # the shared rule, re-exported
from omni_mesh.connectors.allocator import PoolAllocator, frame_alignment, round_up
from omni_mesh.connectors.base import ConnectorConfigError, ConnectorError

INSTALL_HINT = (
    "install it with `pip install 'omni-mesh[mooncake]'` (the non-CUDA wheel, CPU/TCP) or "
    "`pip install 'omni-mesh[mooncake-cuda]'` on GPU hosts"
)
PROTOCOLS = ("tcp", "rdma")


def import_mooncake(module: str, owner: str) -> ModuleType:
    """Import `mooncake.engine` / `mooncake.store` on first use, with an error that says what to install."""
    # glog prints ~10 lines per engine at INFO; users can still ask for more by setting it themselves.
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    if module not in sys.modules and yuanrong_loaded_first():
        raise ConnectorError(
            f"{owner}: mooncake cannot be loaded after openYuanrong's yr.datasystem in one process: their "
            "native libraries clash and the process would crash. Create Mooncake connectors first "
            "(`omni-mesh stage` does), or import mooncake before yr.datasystem"
        )
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        detail = str(exc)
        if "libibverbs" in detail:
            raise ConnectorError(
                f"{owner}: the mooncake library cannot load ({detail}); install the RDMA userspace library "
                "with `apt-get install -y libibverbs1` (no RDMA hardware is needed)"
            ) from exc
        raise ConnectorError(
            f"{owner}: the mooncake library is not available ({detail}); {INSTALL_HINT}"
        ) from exc


def yuanrong_loaded_first() -> bool:
    """yr.datasystem is loaded and mooncake is not: loading mooncake now would segfault (measured)."""
    mooncake = any(name in sys.modules for name in ("mooncake.engine", "mooncake.store"))
    return not mooncake and any(name.split(".")[:2] == ["yr", "datasystem"] for name in sys.modules)


def close_at_exit(connector: Any) -> None:
    """Close `connector` at interpreter exit, in order, unless it is gone by then (held weakly)."""
    atexit.register(_close_if_alive, weakref.ref(connector))


def _close_if_alive(ref: weakref.ref) -> None:
    connector = ref()
    if connector is not None:
        with contextlib.suppress(Exception):  # at exit there is nobody left to tell
            connector.close()


def payload_name(from_stage: str, to_stage: str, key: str) -> str:
    """How errors name one payload."""
    return f"key {key!r} on edge {from_stage}->{to_stage}"


def check_protocol(owner: str, protocol: str) -> None:
    if protocol not in PROTOCOLS:
        raise ConnectorConfigError(
            f"{owner}: protocol must be one of {', '.join(PROTOCOLS)}, got {protocol!r}"
        )


def split_address(address: str, owner: str, what: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConnectorConfigError(f"{owner}: {what} must look like HOST:PORT, got {address!r}")
    return host.strip("[]"), int(port)


def probe_tcp(address: str, timeout_s: float, owner: str, what: str, fix: str) -> None:
    """Fail in `timeout_s` with the address in the message instead of letting a backend retry for minutes."""
    host, port = split_address(address, owner, what)
    started = time.monotonic()
    try:
        socket.create_connection((host, port), timeout=timeout_s).close()
    except OSError as exc:
        waited = time.monotonic() - started
        raise ConnectorError(
            f"{owner}: cannot reach the {what} at {address} (after {waited:.1f}s: {exc or 'timed out'}); {fix}"
        ) from None


def probe_metadata_server(metadata_server: str, timeout_s: float, owner: str) -> None:
    """An http:// metadata server that does not answer would stall the engine; fail fast instead."""
    url = urllib.parse.urlsplit(metadata_server)
    if url.scheme not in ("http", "https") or not url.hostname:
        return  # P2PHANDSHAKE needs no server; etcd endpoint lists are the engine's to dial
    port = url.port or (443 if url.scheme == "https" else 80)
    probe_tcp(
        f"{url.hostname}:{port}",
        timeout_s,
        owner,
        "metadata server",
        f"start it or fix metadata_server ({metadata_server!r}), or use P2PHANDSHAKE",
    )


@dataclass(frozen=True)
class PoolErrors:
    """How a pool's errors name its owner and what to do: `{owner}: {what} needs N bytes but {knob} is
    ...`, `... held by {held_by}); {advice}`. `count` runs for each error raised (health counters)."""

    owner: str
    knob: str
    held_by: str
    advice: str
    count: Callable[[], None]


def _uncounted() -> None:
    """A pool without an owner's counters."""


class RegisteredPool:
    """One anonymous mapping carved into 64-byte aligned regions by a first-fit allocator.

    The owner registers `address`/`size` with the transfer backend once. `view(offset, length)` hands a
    region out as a numpy array whose garbage collection gives the region back, so tensors decoded as
    views over it keep it reserved exactly as long as they live. Finalizers never take the lock (they
    may run inside a locked section of the same thread during GC); they queue the offset instead.
    `reserve`, `check_fits` and `decode` raise ConnectorErrors worded by `errors`.
    """

    def __init__(self, size: int, *, prefault: bool, errors: PoolErrors | None = None) -> None:
        self.errors = errors or PoolErrors("RegisteredPool", "its size", "its users", "free regions sooner", _uncounted)
        self.size = round_up(size, mmap.PAGESIZE)
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | (mmap.MAP_POPULATE if prefault else 0)
        self._mm: mmap.mmap | None = mmap.mmap(-1, self.size, flags=flags)
        self.array = np.frombuffer(self._mm, dtype=np.uint8)
        self.address = self.array.ctypes.data
        self._allocator = PoolAllocator(self.size)
        self._cond = threading.Condition(threading.Lock())
        self._released: collections.deque[int] = collections.deque()

    def allocate(self, nbytes: int, timeout_s: float) -> int | None:
        """Offset of a region of `nbytes`, waiting up to `timeout_s` for space; None if none came free."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while True:
                self._drain_locked()
                offset = self._allocator.allocate(nbytes, align=frame_alignment(nbytes))
                if offset is not None:
                    return offset
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return None
                # Frees through finalizers cannot notify; a short wait slice picks them up.
                self._cond.wait(min(remaining, 0.02))

    def check_fits(self, nbytes: int, what: str) -> None:
        """A frame larger than the pool can never be received (consumers size their pool alike)."""
        if nbytes > self.size:
            e = self.errors
            e.count()
            raise ConnectorError(
                f"{e.owner}: {what} needs {nbytes} bytes but {e.knob} is {self.size} bytes; raise {e.knob} in "
                f"the connector's extra to at least '{-(-nbytes // (1 << 20))}MiB' on both producer and consumer"
            )

    def reserve(self, nbytes: int, timeout_s: float, what: str) -> int:
        """`allocate`, or a ConnectorError saying what holds the pool and what to do."""
        self.check_fits(nbytes, what)
        offset = self.allocate(nbytes, timeout_s)
        if offset is None:
            e = self.errors
            e.count()
            raise ConnectorError(
                f"{e.owner}: {what} waited {timeout_s}s for {nbytes} free bytes of {e.knob} "
                f"({self.in_use} of {self.size} bytes held by {e.held_by}); {e.advice}"
            )
        return offset

    def decode(self, offset: int, length: int, what: str, *, copy: bool, device: list | None = None) -> Any:
        """Decode the frame of `length` bytes at `offset`: views over the region (which stays reserved
        while they live), or copies."""
        region = self.view(offset, length)
        try:
            if codec.frame_length(region) != length:
                raise codec.FrameError(f"frame length differs from the {length} bytes announced")
            return codec.decode(region, copy=copy, device_buffers=device)
        except codec.FrameError as exc:
            self.errors.count()
            raise ConnectorError(f"{self.errors.owner}: bad frame for {what}: {exc}") from None

    def free(self, offset: int) -> None:
        with self._cond:
            self._allocator.free(offset)
            self._cond.notify_all()

    def view(self, offset: int, length: int) -> np.ndarray:
        """A fresh array over one region; the region is freed when it and every view of it are gone."""
        # Made from the mapping itself, not sliced from `array`: numpy collapses a slice's base to
        # `array`, and decoded tensors would then keep `array` alive instead of this region.
        region = np.frombuffer(self._mm, dtype=np.uint8, count=length, offset=offset)
        weakref.finalize(region, self._release, offset)
        return region

    def _release(self, offset: int) -> None:
        self._released.append(offset)
        if self._cond.acquire(blocking=False):
            try:
                self._drain_locked()
                self._cond.notify_all()
            finally:
                self._cond.release()

    def _drain_locked(self) -> None:
        while self._released:
            offset = self._released.popleft()
            if offset in self._allocator:
                self._allocator.free(offset)

    @property
    def in_use(self) -> int:
        with self._cond:
            self._drain_locked()
            return self._allocator.in_use

    def close(self) -> None:
        """Drop this object's hold on the memory; arrays still viewing it keep it mapped until they die."""
        self.array = np.empty(0, dtype=np.uint8)
        self._mm = None


def pool_status(pool: RegisteredPool | None, *, up: bool, strained: bool = False) -> tuple[str, int, int]:
    """(health status, bytes in use, size) of a connector around one pool: "unhealthy" when it is not
    `up`, "degraded" when `strained` or the pool is over 90% full."""
    in_use = pool.in_use if pool is not None else 0
    size = pool.size if pool is not None else 0
    if not up or pool is None:
        return "unhealthy", in_use, size
    return ("degraded" if strained or in_use > 0.9 * size else "healthy"), in_use, size
