"""SharedMemoryConnector's tiny payloads (frames up to `inline_max_bytes`): in the metadata, and in the pool.

A tiny payload travels in its metadata as its whole frame (`frame`). Once some process on the host
has got a payload by key alone (shm_wanted, which says why not before), a copy goes into one of the
first segment's cells (shm_cells) or, with every cell waiting, a pool slot, where a get by key finds
it; the get with the metadata releases that copy. The payloads put shortly before are copied in then
(shm_recent). With the pool full a tiny payload travels in the metadata only, in the parts form
(`inline`, `parts`). The metadata holds the whole payload, so a get with it always succeeds, as
vllm-omni's inline payloads do: the coordinator retries a stage whose replica died after its get,
with the same metadata, and the retry must find its input.
"""

from __future__ import annotations

import ctypes
import threading
import time
from collections.abc import Callable
from typing import Any

from omni_mesh import codec
from omni_mesh.connectors.counters import Counters
from omni_mesh.connectors.errors import ConnectorClosed, ConnectorError
from omni_mesh.connectors.keys import edge_key, payload_name
from omni_mesh.connectors.shm import cells as shm_cells
from omni_mesh.connectors.shm import recent as shm_recent
from omni_mesh.connectors.shm import wanted as shm_wanted
from omni_mesh.connectors.shm.maps import Mappings
from omni_mesh.connectors.shm.pool import ShmPool
from omni_mesh.connectors.shm.recent import RecentTiny
from omni_mesh.connectors.shm.slots import (
    FREE,
    RELEASED,
    SLOT,
    SLOT_HEADER,
    STATE_AND_GENERATION,
    TAKEN,
    WRITTEN,
    Segment,
    Slot,
    digest_of,
)


class FrameBytes:
    """A whole frame already in bytes, laid where a FramePlan would be: a remembered tiny payload."""

    __slots__ = ("data", "nbytes")

    def __init__(self, data: bytes) -> None:
        self.data, self.nbytes = data, len(data)

    def write_at(self, address: int) -> int:
        ctypes.memmove(address, self.data, self.nbytes)
        return self.nbytes

    def write_into_map(self, mm: Any, start: int, address: int) -> int:
        mm[start : start + self.nbytes] = self.data
        return self.nbytes

    def to_bytes(self) -> bytes:
        return self.data


# Lays a frame into a pool slot for gets by key: (the slot, its metadata), None with the pool full.
CopyToSlot = Callable[[str, str, str, FrameBytes], "tuple[Slot, dict] | None"]


class TinyPayloads:
    """The producer side of tiny payloads over one pool (module docstring)."""

    def __init__(self, pool: ShmPool, counters: Counters, inline_max_bytes: int, copy_to_slot: CopyToSlot) -> None:
        self._pool = pool
        self._counters = counters
        self._copy_to_slot = copy_to_slot
        self.cell_size = shm_cells.cell_size(SLOT_HEADER, inline_max_bytes)
        self._cell_frame_bytes = self.cell_size - SLOT_HEADER if self.cell_size else -1
        self.cells: shm_cells.Cells | None = None
        self.wanted = False  # a get by key was seen on the host: copies go into the pool
        self._recent = RecentTiny()
        self._watched = False
        self._noticing = threading.Lock()  # the watcher and gets by key in this process, one at a time
        self._copied: list[tuple[Slot | None, int, int]] = []  # (slot, or None: a cell; offset; generation)
        self._copied_until = 0.0

    def lay_out_locked(self, segment: Segment, start: int) -> None:
        """The cells at `start` of the first segment, described in its header for consumers."""
        self.cells = shm_cells.Cells(segment.mm, start, self.cell_size, reusable=(RELEASED,), writing=FREE)
        shm_cells.describe(segment.mm, start, self.cell_size)

    @staticmethod
    def spill(key: str, frame: codec.FramePlan, written: tuple[Slot, dict] | None) -> tuple[int, dict]:
        """(size, metadata) of a tiny put the cells had no room for: its copy `written` into a pool
        slot, or, with the pool full too (None), in the metadata alone in the parts form."""
        if written is None:
            return frame.payload_bytes, {"inline": frame.header, "parts": frame.inline_parts(), "key": key}
        slot, laid = written
        start = slot.offset + SLOT_HEADER
        metadata = {name: laid[name] for name in ("segment", "offset", "generation")}
        metadata["frame"] = slot.segment.mm[start : start + frame.nbytes]
        metadata["key"] = key
        return frame.nbytes, metadata

    def put(
        self, from_stage: str, to_stage: str, put_key: str, key: str, frame: codec.FramePlan | FrameBytes
    ) -> tuple[int, dict] | None:
        """(size, metadata) of a tiny put, the frame in the metadata; `key` is its edge key. Unwanted
        by key, that is all (remembered for a later copy-in); wanted, a copy goes into a free cell too,
        and None says every cell waits for its consumer: then `spill` it.

        Cells are not entered in the key index: a get by key scans them (there are few), which keeps
        this, the path of every tiny put, to one lock and two copies."""
        size = frame.nbytes
        pool = self._pool
        framed = None if self.wanted else frame.to_bytes()  # outside the lock; wanted never turns back
        with pool.lock:
            if pool.closed:
                raise ConnectorClosed(f"SharedMemoryConnector is closed (put of {key!r})")
            first = pool.first_locked()  # the pool a get by key flags (shm_wanted)
            if not self.wanted:
                if not self._watched and shm_wanted.marked(first.mm):
                    self.wanted = True  # flagged before our first tiny put: nothing to copy in
                else:
                    self._recent.remember(from_stage, to_stage, put_key, framed)
                    if not self._watched:
                        self._watched = True
                        shm_wanted.watch(self)
                    return size, {"frame": framed, "key": key}
            if size > self._cell_frame_bytes:
                return None
            offset = self.cells.take(put_key)
            if offset is None:
                return None
            generation = pool.next_generation()
        mm = first.mm
        start = offset + SLOT_HEADER
        try:
            frame.write_into_map(mm, start, first.address + start)
        except BaseException:
            with pool.lock:
                self.cells.give_back(offset, FREE)
            raise
        framed = mm[start : start + size]
        _seal(mm, offset, generation, key, size)
        return size, {"segment": first.name, "offset": offset, "generation": generation, "frame": framed, "key": key}

    def notice_wanted(self) -> bool:
        """For the watcher (shm_wanted): once the pool is flagged, copy in the recent tiny payloads;
        BACKFILL_S later free the copies nobody took. True once there is nothing more to do. One caller
        at a time: a get by key in this process that calls it while the watcher copies waits for it."""
        with self._noticing:
            pool = self._pool
            with pool.lock:
                first = pool.first
                if pool.closed or first is None:
                    return True
                if self.wanted:
                    if self._copied and time.monotonic() >= self._copied_until:
                        self._free_copies_locked()
                    return not self._copied
                if not shm_wanted.marked(first.mm):
                    return False
                self.wanted = True
                recent = self._recent.take()
                self._copied_until = time.monotonic() + shm_recent.BACKFILL_S
            for from_stage, to_stage, put_key, framed, _ in recent:
                try:
                    self._copy_in(from_stage, to_stage, put_key, framed)
                except ConnectorError:
                    if pool.closed:
                        return True  # closed meanwhile: nothing left to copy into
                    raise
            with pool.lock:
                return not self._copied

    def _copy_in(self, from_stage: str, to_stage: str, put_key: str, framed: bytes) -> None:
        """A copy of a payload put before the pool was flagged, for a get by key: a put as any tiny
        one now (a cell), or a pool slot with every cell waiting."""
        frame = FrameBytes(framed)
        put = self.put(from_stage, to_stage, put_key, edge_key(from_stage, to_stage, put_key), frame)
        if put is not None:
            copy: tuple[Slot | None, int, int] = (None, put[1]["offset"], put[1]["generation"])
        else:
            written = self._copy_to_slot(from_stage, to_stage, put_key, frame)
            if written is None:
                return  # the pool is full: its metadata still holds it
            slot = written[0]
            copy = (slot, slot.offset, slot.generation)
        with self._pool.lock:
            self._copied.append(copy)

    def _free_copies_locked(self) -> None:
        """Free the copied-in payloads no get by key took: their consumers had the metadata."""
        pool, cells = self._pool, self.cells
        for slot, offset, generation in self._copied:
            if slot is None:
                if cells is not None and STATE_AND_GENERATION.unpack_from(cells.mm, offset) == (WRITTEN, generation):
                    cells.free(offset, FREE)
            elif (
                pool.slots.get((slot.segment.name, offset)) is slot
                and slot.generation == generation
                and slot.segment.mm[offset] == WRITTEN
            ):
                pool.free_locked(slot)
        self._copied = []

    def clean_locked(self, key: str) -> None:
        self._recent.cleaned(key)
        if self.cells is not None:
            self.cells.clean(key, waiting=WRITTEN, free=FREE)

    def close_locked(self) -> None:
        # Not unwatched here: close() runs from __del__, which the garbage collector may call inside the
        # watcher's own lock (a deadlock); a closed pool's notice_wanted says "done" at the next tick.
        self._recent.clear()
        self._copied = []
        self.cells = None

    def waiting_locked(self) -> int:
        """Cells holding a payload nobody has released yet."""
        return len(self.cells) if self.cells is not None else 0


def _seal(mm: Any, offset: int, generation: int, key: str, size: int) -> None:
    """The slot header of a cell whose frame is written; the state byte goes last, so that a consumer
    never sees WRITTEN before the frame is complete."""
    SLOT.pack_into(mm, offset, TAKEN, 0, 0, generation, digest_of(key), size)
    mm[offset] = WRITTEN


def get(
    from_stage: str, to_stage: str, get_key: str, metadata: dict, maps: Mappings, counters: Counters
) -> tuple[Any, int] | None:
    """A tiny payload from its metadata (`frame`, or `inline` and `parts`); None for metadata of
    another edge or key. The pool copy a `frame` names is released."""
    if metadata.get("key") != edge_key(from_stage, to_stage, get_key):
        return None  # metadata of another key or edge: never hand out its data
    framed = metadata.get("frame")
    try:
        if framed is not None:
            if type(framed) is not bytes:
                return None
            if "segment" in metadata:  # a copy in the pool, made for gets by key
                _release_copy(metadata, maps, from_stage, to_stage, get_key)
            data, size = codec.decode(framed), len(framed)
        else:
            inline, parts = metadata.get("inline"), metadata.get("parts")
            data = codec.decode_parts(inline, parts)
            size = len(inline) + sum(map(len, parts))
    except codec.FrameError as exc:
        counters.add("errors")
        where = payload_name(from_stage, to_stage, get_key)
        raise ConnectorError(f"SharedMemoryConnector: bad inline payload for {where}: {exc}") from None
    counters.add_pair("gets", "bytes_got", size)
    return data, size


def _release_copy(metadata: dict, maps: Mappings, from_stage: str, to_stage: str, get_key: str) -> bool:
    """Release the pool copy of a tiny payload (put for gets by key); False if someone else took it or
    it was freed. A producer that is gone took its copy along: the inline data stands."""
    name, offset, generation = metadata.get("segment"), metadata.get("offset"), metadata.get("generation")
    if type(name) is not str or type(offset) is not int or type(generation) is not int:
        return False
    # The cached mapping first: the message naming the get is only built when one must be made.
    mm = maps.get(name) or maps.map(name, payload_name(from_stage, to_stage, get_key))
    if mm is None:
        return True
    if not 0 <= offset <= len(mm) - SLOT_HEADER:
        return False
    # Generations are unique within a producer: with the segment they name this one put.
    if STATE_AND_GENERATION.unpack_from(mm, offset) != (WRITTEN, generation):
        return False
    mm[offset] = RELEASED
    return True
