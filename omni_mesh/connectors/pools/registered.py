"""A registered memory pool: anonymous mappings that transfer engines read payload frames from and
write them into, growing by pre-faulted mappings up to a ceiling (Mooncake's connectors, Mori).
"""

from __future__ import annotations

import collections
import contextlib
import mmap
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from omni_mesh import codec
from omni_mesh.connectors.errors import ConnectorError, ConnectorFull, PayloadTooLarge
from omni_mesh.connectors.pools import growth
from omni_mesh.connectors.pools.allocator import PoolAllocator, frame_alignment, round_up


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


class _Region:
    """One anonymous mapping of a pool, at `base` in the pool's offset space."""

    __slots__ = ("base", "mm", "array", "address", "allocator", "last_used")

    def __init__(self, base: int, size: int, prefault: bool) -> None:
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | (mmap.MAP_POPULATE if prefault else 0)
        self.base = base
        self.mm: mmap.mmap | None = mmap.mmap(-1, size, flags=flags)
        self.array = np.frombuffer(self.mm, dtype=np.uint8)
        self.address = self.array.ctypes.data
        self.allocator = PoolAllocator(size)
        self.last_used = time.monotonic()


class RegisteredPool:
    """Anonymous mappings carved into 64-byte aligned regions by first-fit allocators.

    The owner registers `address`/`size` (the first mapping) with the transfer backend once. With
    `register` (and a `ceiling` above `size`) the pool grows: a request that fits no free space adds a
    pre-faulted mapping sized for it (rounded up to growth.GROW_STEP), registered through `register(address,
    size) -> bool`, instead of waiting; mappings added that way that held nothing for `idle_s` are
    unregistered and dropped. Offsets are one space across mappings: `address_of(offset)` is where the
    bytes lie, `buffer(offset, n)` a writable array over them.

    `view(offset, length)` hands a region out as a numpy array whose garbage collection gives the
    region back, so tensors decoded as views over it keep it reserved exactly as long as they live.
    Finalizers never take the lock (they may run inside a locked section of the same thread during
    GC); they queue the offset instead. `reserve`, `check_fits` and `decode` raise ConnectorErrors
    worded by `errors`: PayloadTooLarge past the ceiling, ConnectorFull when no room came free in time.
    """

    def __init__(
        self,
        size: int,
        *,
        prefault: bool,
        errors: PoolErrors | None = None,
        ceiling: int = 0,
        register: Callable[[int, int], bool] | None = None,
        unregister: Callable[[int], None] | None = None,
        idle_s: float = 30.0,
    ) -> None:
        self.errors = errors or PoolErrors(
            "RegisteredPool", "its size", "its users", "free regions sooner", _uncounted
        )
        self.size = round_up(size, mmap.PAGESIZE)
        first = _Region(0, self.size, prefault)
        self._regions = [first]
        self.array = first.array
        self.address = first.address
        self._prefault = prefault
        self._register, self._unregister, self._idle_s = register, unregister, idle_s
        self.ceiling = max(ceiling, self.size) if register is not None else self.size
        self._next_base = self.size
        self.grown = self.released = 0
        self._cond = threading.Condition(threading.Lock())
        self._released: collections.deque[int] = collections.deque()

    def allocate(self, nbytes: int, timeout_s: float) -> int | None:
        """Offset of a region of `nbytes`, growing the pool or waiting up to `timeout_s` for space;
        None if none came free."""
        placed = self.place(nbytes, timeout_s)
        return None if placed is None else placed[0]

    def place(self, nbytes: int, timeout_s: float) -> tuple[int, int] | None:
        """`allocate`, with the address the region lies at: (offset, address), in one lock round trip."""
        deadline = time.monotonic() + timeout_s
        align = frame_alignment(nbytes)
        with self._cond:
            while True:
                self._drain_locked()
                if len(self._regions) > 1:
                    self._release_idle_locked()
                for region in self._regions:
                    offset = region.allocator.allocate(nbytes, align=align)
                    if offset is not None:
                        region.last_used = time.monotonic()
                        return region.base + offset, region.address + offset
                grown = self._grow_locked(nbytes)
                if grown is not None:
                    offset = grown.allocator.allocate(nbytes, align=align)
                    return grown.base + offset, grown.address + offset
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return None
                # Frees through finalizers cannot notify; a short wait slice picks them up.
                self._cond.wait(min(remaining, 0.02))

    def _grow_locked(self, nbytes: int) -> _Region | None:
        size = growth.grown_size(nbytes + mmap.PAGESIZE)
        if self._register is None or self.capacity_locked() + size > self.ceiling:
            return None
        try:
            region = _Region(self._next_base, size, self._prefault)
        except OSError:
            return None
        if not self._register(region.address, size):
            region.array, region.mm = np.empty(0, dtype=np.uint8), None
            return None
        self._next_base += size
        self._regions.append(region)
        self.grown += 1
        return region

    def _release_idle_locked(self) -> None:
        cutoff = time.monotonic() - self._idle_s
        for region in self._regions[1:]:
            if region.allocator.in_use == 0 and region.last_used <= cutoff:
                self._regions.remove(region)
                self._drop(region)
                self.released += 1

    def _drop(self, region: _Region) -> None:
        if self._unregister is not None:
            with contextlib.suppress(Exception):  # the engine may be going away
                self._unregister(region.address)
        region.array, region.mm = np.empty(0, dtype=np.uint8), None  # views still alive keep it mapped

    def _region_locked(self, offset: int) -> _Region:
        for region in reversed(self._regions):
            if offset >= region.base:
                return region
        raise KeyError(offset)

    def address_of(self, offset: int) -> int:
        with self._cond:
            region = self._region_locked(offset)
            return region.address + offset - region.base

    def buffer(self, offset: int, length: int) -> np.ndarray:
        """A writable array over [offset, offset + length) (to lay a frame into)."""
        with self._cond:
            region = self._region_locked(offset)
            return region.array[offset - region.base : offset - region.base + length]

    def contains(self, address: int, length: int) -> bool:
        """Whether [address, address + length) lies in one mapping of the pool (registered already)."""
        with self._cond:
            for region in self._regions:
                if region.address <= address and address + length <= region.address + region.allocator.size:
                    return True
            return False

    def check_fits(self, nbytes: int, what: str) -> None:
        """A frame larger than the pool can ever be is never received (consumers size their pool alike)."""
        if nbytes > self.ceiling:
            e = self.errors
            e.count()
            raise PayloadTooLarge(
                f"{e.owner}: {what} needs {nbytes} bytes but {e.knob} is {self.ceiling} bytes; raise {e.knob} in "
                f"the connector's extra to at least '{-(-nbytes // (1 << 20))}MiB' on both producer and consumer"
            )

    def reserve(self, nbytes: int, timeout_s: float, what: str) -> int:
        """`allocate`, or a ConnectorError saying what holds the pool and what to do."""
        return self.reserve_placed(nbytes, timeout_s, what)[0]

    def reserve_placed(self, nbytes: int, timeout_s: float, what: str) -> tuple[int, int]:
        """`reserve`, with the region's address: (offset, address)."""
        self.check_fits(nbytes, what)
        placed = self.place(nbytes, timeout_s)
        if placed is None:
            e = self.errors
            e.count()
            raise ConnectorFull(
                f"{e.owner}: {what} waited {timeout_s}s for {nbytes} free bytes of {e.knob} "
                f"({self.in_use} of {self.capacity} bytes held by {e.held_by}); {e.advice}"
            )
        return placed

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
            self._free_locked(offset)
            self._cond.notify_all()

    def _free_locked(self, offset: int) -> None:
        region = self._region_locked(offset)
        region.allocator.free(offset - region.base)
        region.last_used = time.monotonic()

    def view(self, offset: int, length: int) -> np.ndarray:
        """A fresh array over one region; the region is freed when it and every view of it are gone."""
        with self._cond:
            mapping = self._region_locked(offset)
        # Made from the mapping itself, not sliced from `array`: numpy collapses a slice's base to
        # `array`, and decoded tensors would then keep `array` alive instead of this region.
        region = np.frombuffer(mapping.mm, dtype=np.uint8, count=length, offset=offset - mapping.base)
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
            try:
                region = self._region_locked(offset)
            except KeyError:  # the pool is closed: nothing left to give back to
                continue
            if offset - region.base in region.allocator:
                self._free_locked(offset)

    @property
    def in_use(self) -> int:
        with self._cond:
            self._drain_locked()
            return sum(region.allocator.in_use for region in self._regions)

    def capacity_locked(self) -> int:
        return sum(region.allocator.size for region in self._regions)

    @property
    def capacity(self) -> int:
        """Bytes in all mappings (`size` is the first one's)."""
        with self._cond:
            return self.capacity_locked()

    def close(self) -> None:
        """Drop this object's hold on the memory (grown mappings are unregistered first); arrays still
        viewing it keep it mapped until they die."""
        with self._cond:
            regions, self._regions = self._regions, []
        for region in regions[1:]:
            self._drop(region)
        self.array = np.empty(0, dtype=np.uint8)
        for region in regions[:1]:
            region.array, region.mm = np.empty(0, dtype=np.uint8), None


def pool_status(pool: RegisteredPool | None, *, up: bool, strained: bool = False) -> tuple[str, int, int]:
    """(health status, bytes in use, size) of a connector around one pool: "unhealthy" when it is not
    `up`, "degraded" when `strained` or the pool is over 90% full."""
    in_use = pool.in_use if pool is not None else 0
    size = pool.capacity if pool is not None else 0
    if not up or pool is None:
        return "unhealthy", in_use, size
    return ("degraded" if strained or in_use > 0.9 * size else "healthy"), in_use, size
