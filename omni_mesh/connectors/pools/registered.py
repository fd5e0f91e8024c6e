"""A registered memory pool: anonymous mappings that transfer engines read payload frames from and
write them into, growing by pre-faulted mappings up to a ceiling (Mooncake's connectors). Its slots,
growth and idle release are the one `pools.slots.SlotPool`'s; this adds the mappings, their
registration, waiting for room, and regions freed by the garbage collection of their views.
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
from omni_mesh.connectors.pools.allocator import round_up
from omni_mesh.connectors.pools.growth import anonymous_map
from omni_mesh.connectors.pools.slots import SlotPool


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


class _Mapping:
    """One anonymous mapping of a pool (at a base of its SlotPool's offset space)."""

    __slots__ = ("mm", "array", "address", "size")

    def __init__(self, size: int, prefault: bool) -> None:
        self.mm: mmap.mmap | None = anonymous_map(size, populate=prefault, huge_pages=False)
        self.array = np.frombuffer(self.mm, dtype=np.uint8)
        self.address = self.array.ctypes.data
        self.size = size

    def drop(self) -> None:
        self.array, self.mm = np.empty(0, dtype=np.uint8), None  # views still alive keep it mapped


class RegisteredPool:
    """Anonymous mappings whose offsets a `SlotPool` hands out (64-byte aligned, first fit).

    The owner registers `address`/`size` (the first mapping) with the transfer backend once. With
    `register` (and a `ceiling` above `size`) the pool grows: a request that fits no free space adds a
    pre-faulted mapping sized for it (rounded up to growth.GROW_STEP), registered through `register(address,
    size) -> bool`, instead of waiting; mappings added that way that held nothing for `idle_s` are
    unregistered and dropped. Offsets are one space across mappings: `address_of(offset)` is where the
    bytes lie.

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
        first = _Mapping(self.size, prefault)
        self._mappings = {0: first}  # by base
        self.array = first.array
        self.address = first.address
        self._prefault = prefault
        self._register, self._unregister, self._idle_s = register, unregister, idle_s
        self.ceiling = max(ceiling, self.size) if register is not None else self.size
        # Used under _cond alone (so a finalizer's free never waits for it: see _release).
        self._slots = SlotPool(self.size, ceiling=self.ceiling)
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
        with self._cond:
            while True:
                self._drain_locked()
                for base in self._slots.release_idle(self._idle_s):
                    self._drop(self._mappings.pop(base))
                    self.released += 1
                offset = self._slots.allocate_growing(nbytes, self._grow_locked)
                if offset is not None:
                    base, local = self._slots.region_of(offset)
                    return offset, self._mappings[base].address + local
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return None
                # Frees through finalizers cannot notify; a short wait slice picks them up.
                self._cond.wait(min(remaining, 0.02))

    def _grow_locked(self, base: int, size: int) -> bool:
        """A registered mapping of `size` bytes at `base` (SlotPool.allocate_growing)."""
        try:
            mapping = _Mapping(size, self._prefault)
        except OSError:
            return False
        if not self._register(mapping.address, size):
            mapping.drop()
            return False
        self._mappings[base] = mapping
        self.grown += 1
        return True

    def _drop(self, mapping: _Mapping) -> None:
        if self._unregister is not None:
            with contextlib.suppress(Exception):  # the engine may be going away
                self._unregister(mapping.address)
        mapping.drop()

    def _locate_locked(self, offset: int) -> tuple[_Mapping, int]:
        base, local = self._slots.region_of(offset)
        return self._mappings[base], local

    def address_of(self, offset: int) -> int:
        with self._cond:
            mapping, local = self._locate_locked(offset)
            return mapping.address + local

    def contains(self, address: int, length: int) -> bool:
        """Whether [address, address + length) lies in one mapping of the pool (registered already)."""
        with self._cond:
            return any(
                m.address <= address and address + length <= m.address + m.size
                for m in self._mappings.values()
            )

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
            self._slots.free(offset)
            self._cond.notify_all()

    def view(self, offset: int, length: int) -> np.ndarray:
        """A fresh array over one region; the region is freed when it and every view of it are gone."""
        with self._cond:
            mapping, local = self._locate_locked(offset)
        # Made from the mapping itself, not sliced from `array`: numpy collapses a slice's base to
        # `array`, and decoded tensors would then keep `array` alive instead of this region.
        region = np.frombuffer(mapping.mm, dtype=np.uint8, count=length, offset=local)
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
            if self._mappings and self._slots.holds(offset):  # none: the pool is closed
                self._slots.free(offset)

    @property
    def in_use(self) -> int:
        with self._cond:
            self._drain_locked()
            return self._slots.in_use

    @property
    def capacity(self) -> int:
        """Bytes in all mappings (`size` is the first one's)."""
        with self._cond:
            return self._slots.size

    def close(self) -> None:
        """Drop this object's hold on the memory (grown mappings are unregistered first); arrays still
        viewing it keep it mapped until they die."""
        with self._cond:
            mappings, self._mappings = self._mappings, {}
        for base, mapping in mappings.items():
            if base:
                self._drop(mapping)
            else:
                mapping.drop()
        self.array = np.empty(0, dtype=np.uint8)


def pool_status(pool: RegisteredPool | None, *, up: bool, strained: bool = False) -> tuple[str, int, int]:
    """(health status, bytes in use, size) of a connector around one pool: "unhealthy" when it is not
    `up`, "degraded" when `strained` or the pool is over 90% full."""
    in_use = pool.in_use if pool is not None else 0
    size = pool.capacity if pool is not None else 0
    if not up or pool is None:
        return "unhealthy", in_use, size
    return ("degraded" if strained or in_use > 0.9 * size else "healthy"), in_use, size
