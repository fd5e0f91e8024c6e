"""The one slot pool of the connectors that keep payloads in memory they own (SharedMemoryConnector's
segments, ZmqConnector, the transfer-engine connectors, Mooncake's registered pool): offsets into
regions, growth, idle release.

Bookkeeping only: it never touches memory. Its owner maps (and registers) the memory of each region
at the base the pool gives it, through `map_region(base, size) -> bool` when the pool grows, and
drops it when `release_idle` gives the base back.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from omni_mesh.connectors.pools import growth
from omni_mesh.connectors.pools.allocator import PAGE, PoolAllocator, frame_alignment, round_up


class SlotPool:
    """Thread-safe first-fit offsets (64-byte aligned; large frames page-aligned) into regions.

    The first region has `size` bytes; with a `ceiling` above it the pool grows (`allocate_growing`)
    by a region sized for the payload that did not fit (growth.grown_size), each at a page-aligned
    base in one offset space after the others; `region_of(offset)` says which region an offset lies
    in. Grown regions go back with `release_idle` once they held nothing for a while; the first stays.
    """

    def __init__(self, size: int, *, ceiling: int = 0, start: int = 0) -> None:
        # (base, allocator); the first region's bytes before `start` are its owner's (headers)
        self._regions: list[tuple[int, PoolAllocator]] = [(0, PoolAllocator(size, start=start))]
        self._last_used: dict[int, float] = {}  # base of a grown region -> when it last held something
        self._next_base = round_up(size, PAGE)
        self.ceiling = max(ceiling, round_up(size, PAGE))  # bytes in all regions at most
        self._lock = threading.Lock()
        self._grow_lock = threading.Lock()  # one growth at a time: concurrent puts must not each add one

    def allocate(self, nbytes: int, *, header: int = 0) -> int | None:
        """The offset of `header` bytes followed by an `nbytes` frame; large frames start on a page
        boundary, the header just before it (see PoolAllocator.allocate)."""
        align = frame_alignment(nbytes)
        with self._lock:
            for base, allocator in self._regions:
                offset = allocator.allocate(header + nbytes, align=align, skew=header)
                if offset is not None:
                    if base:
                        self._last_used[base] = time.monotonic()
                    return base + offset
            return None

    def allocate_growing(
        self, nbytes: int, map_region: Callable[[int, int], bool], *, header: int = 0
    ) -> int | None:
        """`allocate`, growing the pool by a region for the frame if none is free and the ceiling
        allows (`map_region(base, size)` maps its memory; False: it could not); None past it."""
        offset = self.allocate(nbytes, header=header)
        if offset is not None or not self.size:
            return offset
        with self._grow_lock:
            offset = self.allocate(nbytes, header=header)
            room = self.ceiling - self.size
            size = growth.grown_size(header + nbytes + frame_alignment(nbytes), room)
            if offset is not None or size > room:
                return offset
            base = self._next_base  # no other growth moves it meanwhile
            if not map_region(base, size):
                return None
            with self._lock:
                self._next_base += round_up(size, PAGE)
                self._regions.append((base, PoolAllocator(size)))
                self._last_used[base] = time.monotonic()
        return self.allocate(nbytes, header=header)

    def _region_locked(self, offset: int) -> tuple[int, PoolAllocator]:
        for base, allocator in reversed(self._regions):
            if offset >= base:
                return base, allocator
        raise KeyError(offset)

    def region_of(self, offset: int) -> tuple[int, int]:
        """(base of the region holding `offset`, offset within that region)."""
        with self._lock:
            base = self._region_locked(offset)[0]
        return base, offset - base

    def holds(self, offset: int) -> bool:
        """Whether `offset` was handed out and not freed since."""
        with self._lock:
            base, allocator = self._region_locked(offset)
            return offset - base in allocator

    def locate(self, offset: int) -> tuple[int, int, int]:
        """`region_of(offset)` and the bytes from `offset` to the end of what was handed out there
        (alignment slack included: a later frame that fits may reuse them), in one lock round trip."""
        with self._lock:
            base, allocator = self._region_locked(offset)
            local = offset - base
            return base, local, allocator.extent_end(local) - local

    def free(self, offset: int) -> None:
        with self._lock:
            base, allocator = self._region_locked(offset)
            allocator.free(offset - base)
            if base:
                self._last_used[base] = time.monotonic()

    def release_idle(self, idle_s: float) -> list[int]:
        """Drop grown regions that held nothing for `idle_s`; returns their bases."""
        if len(self._regions) == 1:  # the usual case: nothing grown, no lock taken
            return []
        cutoff = time.monotonic() - idle_s
        with self._lock:
            idle = [b for b, a in self._regions[1:] if a.in_use == 0 and self._last_used[b] <= cutoff]
            self._regions = [(b, a) for b, a in self._regions if b not in idle]
            for base in idle:
                del self._last_used[base]
            return idle

    @property
    def size(self) -> int:
        """Bytes in all regions."""
        with self._lock:
            return sum(allocator.size for _, allocator in self._regions)

    @property
    def regions(self) -> int:
        with self._lock:
            return len(self._regions)

    @property
    def in_use(self) -> int:
        with self._lock:
            return sum(allocator.in_use for _, allocator in self._regions)
