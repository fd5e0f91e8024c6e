"""Fixed cells for tiny payloads in a SharedMemoryConnector pool.

A tiny payload travels in its metadata, but a get by key alone must find it in shared memory too
(shm_index). Going through the pool's allocator and the key index for every tiny put would cost more
than the put itself, so each pool keeps COUNT cells of one size after its key index, described in the
pool's header (GEOMETRY at byte 0) so that a consumer's get by key scans them (`find`). A
cell is reusable once its consumer released it (or it was never used, or cleaned up). Cells are
handed out round-robin; there are few of them, so a steady stream cycles through pages already mapped
and faulted in on both sides (512 cost a page fault per get, measured; first-fit from cell 0 measured
slower still). With every cell waiting for its consumer, a tiny put takes a pool slot instead. Every cell
starts with the same 64-byte slot header as a pool slot, so consumers read cells and slots alike.
Not thread-safe: the connector calls it under its lock.
"""

from __future__ import annotations

import struct
from typing import Any

from omni_mesh.connectors.keys import cleaned_by

COUNT = 16  # few, so a steady stream cycles through pages already faulted in on both sides
MAX_FRAME = 16 * 1024  # tiny payloads larger than this use the allocator
_GENERATION = struct.Struct("<Q")
GEOMETRY = struct.Struct("<8sIII")  # magic, first cell's offset, cell size, cell count
_MAGIC = b"omcells1"
_DIGEST_AT = 24  # where the slot header keeps the key digest


def cell_size(slot_header: int, inline_max_bytes: int) -> int:
    """Bytes per cell (a multiple of 64), 0 when tiny payloads are too large for cells."""
    frame = min(inline_max_bytes, MAX_FRAME)
    return 0 if frame <= 0 else slot_header + (frame + 63) // 64 * 64


def describe(mm: Any, start: int, size: int) -> None:
    """Record the cells' place in the pool header, for consumers in other processes."""
    GEOMETRY.pack_into(mm, 0, _MAGIC, start, size, COUNT if size else 0)


def find(mm: Any, digest: bytes) -> list[int]:
    """Offsets of the cells of a pool whose slot header names `digest` (their state unchecked)."""
    if len(mm) < GEOMETRY.size:
        return []
    magic, start, size, count = GEOMETRY.unpack_from(mm, 0)
    if magic != _MAGIC or not size or len(mm) < start + count * size:
        return []
    at = start + _DIGEST_AT
    return [start + i * size for i in range(count) if mm[at + i * size : at + i * size + 16] == digest]


class Cells:
    """COUNT cells of `size` bytes at `start` of `mm` (module docstring)."""

    def __init__(self, mm: Any, start: int, size: int, *, reusable: tuple[int, ...], writing: int) -> None:
        self.mm, self.start, self.size = mm, start, size
        self._reusable = reusable  # slot states in which a cell may be handed out again
        self._writing = writing  # the state of a cell taken by a put that has not sealed it yet
        self._keys: list[str | None] = [None] * (COUNT if size else 0)
        self._next = 0

    def take(self, put_key: str) -> int | None:
        """The offset of a free cell, now owned by `put_key`; None if none. It shows `writing` until its
        put seals it: neither a consumer nor another put (in another thread) takes it meanwhile."""
        mm, keys, reusable = self.mm, self._keys, self._reusable
        count = len(keys)
        for _ in range(count):
            index = self._next
            self._next = index + 1 if index + 1 < count else 0
            offset = self.start + index * self.size
            if keys[index] is None or mm[offset] in reusable:
                keys[index] = put_key
                mm[offset] = self._writing
                return offset
        return None

    def give_back(self, offset: int, free: int) -> None:
        """A put that failed to fill the cell: it is free again."""
        index = (offset - self.start) // self.size
        self._keys[index] = None
        self.mm[offset] = free

    def clean(self, key: str, *, waiting: int, free: int) -> None:
        """Free the cells of `key` (or `key/...`) that still wait for their consumer."""
        for index, owner in enumerate(self._keys):
            if owner is not None and cleaned_by(owner, key):
                offset = self.start + index * self.size
                if self.mm[offset] == waiting:
                    self.free(offset, free)

    def free(self, offset: int, free: int) -> None:
        """Free a cell nobody holds: its generation is cleared first, so stale metadata never matches."""
        _GENERATION.pack_into(self.mm, offset + 16, 0)
        self.mm[offset] = free
        self._keys[(offset - self.start) // self.size] = None

    def __len__(self) -> int:
        """Cells holding a payload nobody has released yet."""
        return sum(1 for i, k in enumerate(self._keys) if k is not None and self.mm[self.start + i * self.size] not in self._reusable)
