"""SharedMemoryConnector: payloads between processes on one host, through a pre-faulted pool.

Producer side: one pool segment per process, created on the first large put and pre-faulted, so the
steady state creates no segment and takes no page fault. The codec lays each frame straight into a
pool slot. Payloads larger than the free pool space get a one-off segment (the fallback path); tiny
ones ride inline in the metadata.

Consumer side: `get` maps the producer's segment once (cached) and decodes tensors and arrays as
views over the slot: no copy at all. When the last view is garbage-collected, the consumer marks the
slot released in the slot header, and the producer reuses the space on its next put. So ownership
needs no message back: the slot header in shared memory is the protocol.

    slot header (64 bytes, little-endian): state u8, pad, taker pid u32, taker pidns u32,
                                           generation u64, key digest 16 bytes, frame length u64
    state: FREE -> WRITTEN (producer) -> TAKEN (consumer) -> RELEASED (consumer) -> FREE (producer)

The generation and the digest of `from->to/key` make stale or foreign metadata detectable: `get`
then returns None instead of another request's data. A slot taken by a consumer that has died is
reclaimed when the pool runs short.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import itertools
import mmap
import os
import struct
import threading
import weakref
from dataclasses import dataclass
from typing import Any

import numpy as np

from omni_mesh import codec, cuda_ipc
from omni_mesh.connectors import shm_cells, shm_index
from omni_mesh.connectors.allocator import PAGE, PoolAllocator, frame_alignment, round_up
from omni_mesh.connectors.base import ConnectorError, Counters, OmniConnectorBase, edge_key
from omni_mesh.connectors.shm_segments import (
    SHM_DIR,
    ProcessIdentity,
    create_segment,
    list_segments,
    new_token,
    open_segment,
    process_start_time,
    reap_orphaned_segments,
    segment_name,
    unlink_segment,
)

__all__ = ["SharedMemoryConfig", "SharedMemoryConnector", "reap_orphaned_segments"]

SLOT = struct.Struct("<B3xII4xQ16sQ")  # generation at byte 16
SLOT_HEADER = 64
POOL_HEADER = 64
CELLS_START = POOL_HEADER + shm_index.INDEX_BYTES  # the pool: header, key index, tiny-payload cells, slots
FREE, WRITTEN, TAKEN, RELEASED = 0, 1, 2, 3
_TAKER = struct.Struct("<II")
_GENERATION = struct.Struct("<Q")
_STATE_AND_GENERATION = struct.Struct("<B15xQ")  # the first 24 bytes of a slot header
CLOSE_WAIT_S = 30.0
REUSE_SLACK = 2 * PAGE  # a released slot is refilled by a put this much smaller at most


@dataclass(frozen=True)
class SharedMemoryConfig:
    memory_pool_size: int = 256 * 1024 * 1024
    #: Frames up to this size travel inside the metadata instead of through shared memory.
    inline_max_bytes: int = 16 * 1024
    #: Copy tensors out on get (releasing the slot at once) instead of returning views over it.
    copy_on_get: bool = False
    #: Fault the pool's pages in when it is created, so no put pays for them.
    prefault: bool = True
    #: Pass CUDA tensors by CUDA IPC handle (the consumer maps them on the same device: no copy through
    #: host memory). False copies them to host memory at put, like every other connector.
    cuda_ipc: bool = True


class _Segment:
    __slots__ = ("name", "mm", "allocator", "address")

    def __init__(self, name: str, mm: mmap.mmap, allocator: PoolAllocator | None) -> None:
        self.name = name
        self.mm = mm
        self.allocator = allocator  # None for a one-off fallback segment
        self.address = _address_of(mm)  # valid while mm is open; puts write through it


def _address_of(mm: mmap.mmap) -> int:
    anchor = ctypes.c_char.from_buffer(mm)
    address = ctypes.addressof(anchor)
    del anchor  # the buffer export must not outlive this call, or mm.close() would fail
    return address


@dataclass(slots=True, eq=False)  # hashed by identity: sets of slots being written
class _Slot:
    segment: _Segment
    offset: int  # of the slot header; the frame follows it
    generation: int
    put_key: str
    capacity: int  # bytes from offset to the end of its allocation: a later put that fits may reuse it
    exports: list[cuda_ipc.Exported] | None = None  # CUDA tensors the frame passes by IPC handle


def _digest(from_stage: str, to_stage: str, key: str) -> bytes:
    return _digest_of(edge_key(from_stage, to_stage, key))


def _digest_of(name: str) -> bytes:
    """The 16-byte digest of `from->to/key` that slot headers and the key index carry."""
    return hashlib.blake2b(name.encode(), digest_size=16).digest()


def _where(from_stage: str, to_stage: str, key: str) -> str:
    return f"key {key!r} on edge {from_stage}->{to_stage}"


def _metadata_problem(metadata: dict) -> str:
    for field, kind in (("segment", str), ("offset", int), ("generation", int), ("length", int)):
        if field not in metadata:
            return f"lacks {field!r}: {metadata!r}"
        value = metadata[field]
        if type(value) is not kind or (kind is int and value < 0):
            return f"has a bad {field!r} ({value!r})"
    return f"is malformed: {metadata!r}"


def _taker_died(mm: mmap.mmap, offset: int) -> bool:
    """Whether the consumer that took this slot is gone (only decidable in our own PID namespace)."""
    pid, pidns = _TAKER.unpack_from(mm, offset + 4)
    return pidns == ProcessIdentity.current().pidns and pid != 0 and process_start_time(pid) is None


def _release(mm: mmap.mmap, offset: int, generation: int) -> None:
    """Hand a consumed payload's slot back to its producer."""
    with contextlib.suppress(ValueError):  # the mapping was closed: nothing left to release
        if struct.unpack_from("<Q", mm, offset + 16)[0] == generation:
            mm[offset] = RELEASED


# Consumed payloads whose views are alive, by id of the weak reference to the buffer they share. A
# weakref callback costs a fraction of weakref.finalize on the get path; the table keeps each
# reference (and so its callback) alive until it fires.
_HELD: dict[int, tuple[weakref.ref, mmap.mmap, int, int]] = {}


def _hold_until_dead(base: np.ndarray, mm: mmap.mmap, offset: int, generation: int) -> None:
    ref = weakref.ref(base, _views_dead)
    _HELD[id(ref)] = (ref, mm, offset, generation)


def _views_dead(ref: weakref.ref) -> None:
    held = _HELD.pop(id(ref), None)
    if held is not None:
        _release(*held[1:])


class SharedMemoryConnector(OmniConnectorBase):
    config_class = SharedMemoryConfig
    scope = "host"

    def __init__(self, config: dict[str, Any] | None = None) -> None:
        super().__init__(config)
        self._identity = ProcessIdentity.current()
        self._token = new_token()
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        # Slots that puts are copying into right now: cleanup() leaves them alone, close() waits.
        self._writing: set[_Slot] = set()
        self._pool: _Segment | None = None
        self._fallback_ids = itertools.count(1)
        self._generations = itertools.count(1)
        self._slots: dict[tuple[str, int], _Slot] = {}
        self._own: dict[str, _Segment] = {}
        self._mapped: dict[str, mmap.mmap] = {}
        self._closed = False
        self._counters = Counters(
            "puts",
            "gets",
            "bytes_put",
            "bytes_got",
            "inline_puts",
            "fallbacks",
            "stale_gets",
            "errors",
            "cuda_ipc_tensors",
            "unindexed_puts",
        )
        # key index position -> (mapping, offset, generation, slot or None for a cell) of the payload there
        self._indexed: dict[int, tuple[mmap.mmap, int, int, _Slot | None]] = {}
        self._cell_size = shm_cells.cell_size(SLOT_HEADER, self.config.inline_max_bytes)
        self._cell_frame_bytes = self._cell_size - SLOT_HEADER if self._cell_size else -1
        self._pool_start = CELLS_START + shm_cells.COUNT * self._cell_size
        self._cells: shm_cells.Cells | None = None

    # ------------------------------------------------------------------ producer side

    def _put(self, from_stage: str, to_stage: str, put_key: str, data: Any) -> tuple[bool, int, dict | None]:
        policy = codec.CudaIpcExports() if self.config.cuda_ipc else None
        frame = codec.plan(data, device=policy)
        if policy and policy.exports:
            return self._put_with_exports(from_stage, to_stage, put_key, frame, policy.exports)
        if frame.payload_bytes <= self.config.inline_max_bytes:
            return self._put_inline(from_stage, to_stage, put_key, frame)
        return self._put_frame(from_stage, to_stage, put_key, frame)

    def _put_inline(
        self, from_stage: str, to_stage: str, put_key: str, frame: codec.FramePlan
    ) -> tuple[bool, int, dict]:
        """A tiny payload travels in the metadata as its whole frame. A copy goes into a cell of the
        pool (or, with every cell waiting, a pool slot), where a get by key alone finds it; the get
        with the metadata releases that copy. With the pool full it travels in the metadata only."""
        key = edge_key(from_stage, to_stage, put_key)
        metadata = self._put_cell(from_stage, to_stage, put_key, key, frame)
        if metadata is None:
            written = self._put_frame(from_stage, to_stage, put_key, frame, pool_only=True)
            if written is not None:
                metadata = written[2]
                start = metadata["offset"] + SLOT_HEADER
                metadata["frame"] = self._pool.mm[start : start + frame.nbytes]
        if metadata is None:
            metadata = {"inline": frame.header, "parts": frame.inline_parts()}
            size = frame.payload_bytes
        else:
            size = frame.nbytes
        metadata["key"] = key
        self._count_put(size, "inline_puts")
        return True, size, metadata

    def _put_with_exports(
        self, from_stage: str, to_stage: str, put_key: str, frame: codec.FramePlan, exports: list[cuda_ipc.Exported]
    ) -> tuple[bool, int, dict]:
        """A payload with CUDA tensors always takes a slot: the slot holds the exported tensors until the
        consumer has mapped them (or the payload is freed unconsumed, which gives their references back)."""
        try:
            result = self._put_frame(from_stage, to_stage, put_key, frame, exports)
        except BaseException:
            for exported in exports:
                exported.release_unmapped()
            raise
        self._counters.add("cuda_ipc_tensors", len(exports))
        return result

    def _put_frame(
        self,
        from_stage: str,
        to_stage: str,
        put_key: str,
        frame: codec.FramePlan,
        exports: list[cuda_ipc.Exported] | None = None,
        *,
        pool_only: bool = False,
    ) -> tuple[bool, int, dict] | None:
        size = frame.nbytes
        slot = self._allocate(size, put_key, from_stage, to_stage, pool_only=pool_only)
        if slot is None:
            return None  # pool_only and no room in the pool
        segment, offset, generation = slot.segment, slot.offset, slot.generation
        try:
            frame.write_at(segment.address + offset + SLOT_HEADER)
            slot.exports = exports  # from here on the slot answers for them (a failure above: the caller)
            mm = segment.mm
            # The state byte goes last: a consumer never sees WRITTEN before the frame is complete.
            digest = _digest(from_stage, to_stage, put_key)
            SLOT.pack_into(mm, offset, FREE, 0, 0, generation, digest, size)
            mm[offset] = WRITTEN
            segment_id = 0 if segment.allocator is not None else int(segment.name.rsplit("_x", 1)[1])
            self._index(mm, offset, generation, digest, segment_id, slot)
        finally:
            self._done_writing(slot)
        if pool_only:
            return True, size, {"segment": segment.name, "offset": offset, "generation": generation}
        self._count_put(size)
        metadata = {"segment": segment.name, "offset": offset, "generation": generation, "length": size}
        return True, size, metadata

    def _put_cell(
        self, from_stage: str, to_stage: str, put_key: str, key: str, frame: codec.FramePlan
    ) -> dict | None:
        """Lay a tiny frame into a free cell of the pool (shm_cells); its metadata (the frame included),
        None when no cell is free. Cells are not entered in the key index: a get by key scans them
        (there are few), which keeps this, the path of every tiny put, to one lock and two copies."""
        size = frame.nbytes
        if size > self._cell_frame_bytes:
            return None
        with self._lock:
            if self._closed:
                raise ConnectorError(f"SharedMemoryConnector is closed (put {put_key!r} on {from_stage}->{to_stage})")
            pool = self._pool or self._pool_locked()
            offset = self._cells.take(put_key)
            if offset is None:
                return None
            generation = next(self._generations)
        mm = pool.mm
        start = offset + SLOT_HEADER
        try:
            frame.write_at(pool.address + start)
        except BaseException:
            with self._lock:
                self._cells.give_back(offset, FREE)
            raise
        framed = mm[start : start + size]
        # The state byte goes last: a consumer never sees WRITTEN before the frame is complete.
        SLOT.pack_into(mm, offset, TAKEN, 0, 0, generation, _digest_of(key), size)
        mm[offset] = WRITTEN
        return {"segment": pool.name, "offset": offset, "generation": generation, "frame": framed}

    def _index(
        self, mm: mmap.mmap, offset: int, generation: int, digest: bytes, segment: int, slot: _Slot | None
    ) -> None:
        """Enter a written payload in the pool's key index (shm_index), so a get by key finds it."""
        with self._lock:
            pool = self._pool
            if pool is None:
                return
            position = shm_index.place(pool.mm, POOL_HEADER, digest, generation, offset, segment, self._indexed_live)
            if position is None:
                self._counters.add("unindexed_puts")
            else:
                self._indexed[position] = (mm, offset, generation, slot)

    def _indexed_live(self, position: int) -> bool:
        """Whether the index entry at `position` still names a payload a consumer may take (lock held)."""
        occupant = self._indexed.get(position)
        if occupant is None:
            return False
        mm, offset, generation, slot = occupant
        if (
            (slot is not None and self._slots.get((slot.segment.name, slot.offset)) is not slot)
            or mm.closed
            or _GENERATION.unpack_from(mm, offset + 16)[0] != generation
        ):
            del self._indexed[position]
            return False
        return mm[offset] in (WRITTEN, TAKEN)

    def warm_up(self) -> None:
        with self._lock:
            self._pool_locked()

    def _count_put(self, size: int, extra: str | None = None) -> None:
        self._counters.add_pair("puts", "bytes_put", size, extra)

    def _allocate(
        self, size: int, put_key: str, from_stage: str, to_stage: str, *, pool_only: bool = False
    ) -> _Slot | None:
        """A slot for a `size`-byte frame, counted as being written until `_done_writing`; with
        `pool_only`, None where the pool has no room (no one-off segment)."""
        # Large frames start on a page boundary, the slot header just before it: the codec's placing
        # of large leaves at fast page offsets relies on it.
        need = SLOT_HEADER + size
        align = frame_alignment(size)
        with self._lock:
            if self._closed:
                raise ConnectorError(
                    f"SharedMemoryConnector is closed (put {put_key!r} on {from_stage}->{to_stage})"
                )
            pool = self._pool or self._pool_locked()
            offset = None
            # Always, not only when the pool is the target: released fallback segments are unlinked here.
            if self._slots:
                reused = self._reclaim_locked(check_takers=False, reuse=(need, align))
                if reused is not None:
                    return self._refill_locked(reused, put_key)
            if need + align <= pool.allocator.size - self._pool_start:
                offset = pool.allocator.allocate(need, align=align, skew=SLOT_HEADER)
                if offset is None:
                    self._reclaim_locked(check_takers=True)
                    offset = pool.allocator.allocate(need, align=align, skew=SLOT_HEADER)
            if offset is None and pool_only:
                return None
            if offset is None:
                # A one-off segment; the slot header sits just before its first page boundary.
                skew = PAGE - SLOT_HEADER if align == PAGE else 0
                segment, offset = self._fallback_locked(need + skew, from_stage, to_stage, put_key), skew
            else:
                segment = pool
            # Reused pool space holds bytes of older frames: until this put writes its header, the
            # state byte must not read as RELEASED or TAKEN, or a reclaim would free the slot mid-write.
            segment.mm[offset] = FREE
            capacity = segment.allocator.extent_end(offset) - offset if segment.allocator else need
            slot = _Slot(segment, offset, next(self._generations), put_key, capacity)
            self._slots[(segment.name, offset)] = slot
            self._writing.add(slot)
            return slot

    def _refill_locked(self, slot: _Slot, put_key: str) -> _Slot:
        """A released pool slot that fits the next put, handed to it as it stands.

        Steady streams put payloads of one size: this skips a free and an allocation, and the frame
        lands in memory the last one warmed. The old generation is invalidated first, as in a free.
        """
        mm, offset = slot.segment.mm, slot.offset
        if slot.exports:
            self._drop_exports_locked(slot)
        struct.pack_into("<Q", mm, offset + 16, 0)
        mm[offset] = FREE
        slot.generation = next(self._generations)
        slot.put_key = put_key
        self._writing.add(slot)
        return slot

    def _done_writing(self, slot: _Slot) -> None:
        self._writing.discard(slot)  # atomic; close() sets _closed before it waits, under the lock
        if self._closed:
            with self._lock:
                if not self._writing:
                    self._idle.notify_all()

    def _pool_locked(self) -> _Segment:
        if self._pool is None:
            reserved = self._pool_start - POOL_HEADER  # the key index and the cells
            size = round_up(reserved + max(self.config.memory_pool_size, POOL_HEADER + SLOT_HEADER))
            name = segment_name(self._identity, self._token)
            try:
                mm = create_segment(name, size, populate=self.config.prefault)
            except OSError as exc:
                self._counters.add("errors")
                raise ConnectorError(
                    f"SharedMemoryConnector: no shared memory for a {size}-byte pool: {exc}; free /dev/shm, "
                    f"raise the container's shm_size or lower memory_pool_size"
                ) from exc
            self._pool = _Segment(name, mm, PoolAllocator(size, start=self._pool_start))
            self._own[name] = self._pool
            self._cells = shm_cells.Cells(mm, CELLS_START, self._cell_size, reusable=(RELEASED,), writing=TAKEN)
            shm_cells.describe(mm, CELLS_START, self._cell_size)  # for consumers' gets by key
            self._mapped[name] = mm  # so that gets in this process find it at once
        return self._pool

    def _fallback_locked(self, need: int, from_stage: str, to_stage: str, put_key: str) -> _Segment:
        name = segment_name(self._identity, self._token, f"_x{next(self._fallback_ids)}")
        try:
            mm = create_segment(name, need, populate=False)
        except OSError as exc:
            self._counters.add("errors")
            raise ConnectorError(
                f"SharedMemoryConnector: no shared memory for {need} bytes (put {put_key!r} on "
                f"{from_stage}->{to_stage}): {exc}; free /dev/shm or raise the container's shm_size"
            ) from exc
        self._counters.add("fallbacks")
        segment = _Segment(name, mm, None)
        self._own[name] = segment
        return segment

    def _reclaim_locked(self, *, check_takers: bool, reuse: tuple[int, int] | None = None) -> _Slot | None:
        """Free slots their consumers released; with check_takers, also those held by dead consumers.

        With `reuse` (bytes needed, alignment), the first released pool slot that fits them without
        wasting more than REUSE_SLACK is kept, not freed, and returned for the caller to refill.
        """
        need, align = reuse or (0, 0)
        kept = None
        for slot in list(self._slots.values()):
            state = slot.segment.mm[slot.offset]
            if state == RELEASED or (check_takers and state == TAKEN and self._taker_died(slot)):
                if (
                    reuse is not None
                    and kept is None
                    and need <= slot.capacity <= need + REUSE_SLACK
                    and (slot.offset + SLOT_HEADER) % align == 0
                    and slot.segment.allocator is not None
                ):
                    kept = slot
                else:
                    self._free_locked(slot)
        return kept

    @staticmethod
    def _taker_died(slot: _Slot) -> bool:
        return _taker_died(slot.segment.mm, slot.offset)

    def _free_locked(self, slot: _Slot) -> None:
        segment = slot.segment
        if slot.exports:
            self._drop_exports_locked(slot)
        del self._slots[(segment.name, slot.offset)]
        if segment.allocator is None:
            del self._own[segment.name]
            unlink_segment(segment.name)
            with contextlib.suppress(BufferError):  # views of this process keep it mapped until GC
                segment.mm.close()
            return
        # Invalidate the generation first, so a racing consumer's release or take no longer matches.
        struct.pack_into("<Q", segment.mm, slot.offset + 16, 0)
        segment.mm[slot.offset] = FREE
        segment.allocator.free(slot.offset)

    @staticmethod
    def _drop_exports_locked(slot: _Slot) -> None:
        """Let go of a slot's exported CUDA tensors. A consumer that released the slot mapped them and
        gives their references back itself; any other state means no live consumer will."""
        if slot.segment.mm[slot.offset] != RELEASED:
            for exported in slot.exports:
                with contextlib.suppress(Exception):  # a CUDA error must not stop the reclaim
                    exported.release_unmapped()
        slot.exports = None

    def reap_consumed(self) -> None:
        """Free the slots consumers have released (and those taken by consumers that died) now, rather
        than at the next put that needs room."""
        with self._lock:
            if not self._closed and self._slots:
                self._reclaim_locked(check_takers=True)

    def cleanup(self, key: str) -> None:
        """Free what this process put under `key` (or `key/...`) that no consumer holds."""
        prefix = key + "/"
        with self._lock:
            for slot in list(self._slots.values()):
                owned = slot.put_key == key or slot.put_key.startswith(prefix)
                if owned and slot not in self._writing and slot.segment.mm[slot.offset] != TAKEN:
                    self._free_locked(slot)
            if self._cells is not None:
                self._cells.clean(key, waiting=WRITTEN, free=FREE)

    # ------------------------------------------------------------------ consumer side

    def get(
        self, from_stage: str, to_stage: str, get_key: str, metadata: dict | None = None
    ) -> tuple[Any, int] | None:
        if self._closed:
            raise ConnectorError(f"SharedMemoryConnector is closed (get of {_where(from_stage, to_stage, get_key)})")
        if type(metadata) is not dict or ("segment" not in metadata and "inline" not in metadata):
            return self._get_by_key(from_stage, to_stage, get_key)  # no (or partial) metadata: the key alone
        framed = metadata.get("frame")
        if framed is not None:
            return self._get_framed(from_stage, to_stage, get_key, metadata, framed)
        inline = metadata.get("inline")
        if inline is not None:
            return self._get_inline(from_stage, to_stage, get_key, metadata, inline)
        name, offset = metadata.get("segment"), metadata.get("offset")
        generation, length = metadata.get("generation"), metadata.get("length")
        if (
            type(name) is not str
            or type(offset) is not int
            or type(generation) is not int
            or type(length) is not int
            or offset < 0
            or length < 0
        ):
            where = _where(from_stage, to_stage, get_key)
            raise ConnectorError(f"SharedMemoryConnector: metadata for {where} {_metadata_problem(metadata)}")
        mm = self._mapped.get(name)
        if mm is None:
            mm = self._mapping(name, from_stage, to_stage, get_key)
        if mm is None or offset + SLOT_HEADER + length > len(mm):
            return self._stale()
        state, _, _, slot_generation, digest, slot_length = SLOT.unpack_from(mm, offset)
        if slot_generation != generation or slot_length != length:
            return self._stale()
        # A slot taken by a consumer that died may be taken again: the coordinator retries work
        # whose replica died before producing output, and the retry needs the same input.
        if state != WRITTEN and not (state == TAKEN and _taker_died(mm, offset)):
            return self._stale()
        if digest != _digest(from_stage, to_stage, get_key):
            return self._stale()
        _TAKER.pack_into(mm, offset + 4, self._identity.pid, self._identity.pidns)
        mm[offset] = TAKEN
        base = np.frombuffer(mm, dtype=np.uint8, count=length, offset=offset + SLOT_HEADER)
        try:
            data = codec.decode(base, copy=self.config.copy_on_get, cuda_local=self._own_exports(name, offset))
        except codec.FrameError as exc:
            self._counters.add("errors")
            where = _where(from_stage, to_stage, get_key)
            raise ConnectorError(f"SharedMemoryConnector: bad frame for {where}: {exc}") from None
        except cuda_ipc.CudaIpcUnavailable as exc:
            self._counters.add("errors")
            where = _where(from_stage, to_stage, get_key)
            raise ConnectorError(f"SharedMemoryConnector: cannot map the CUDA tensors of {where}: {exc}") from None
        finally:
            # With views alive, the slot goes back when they die; otherwise right now.
            _hold_until_dead(base, mm, offset, generation)
            del base
        self._counters.add_pair("gets", "bytes_got", length)
        return data, length

    def _wait_once(
        self, from_stage: str, to_stage: str, get_key: str, metadata: dict | None, deadline: float
    ) -> tuple[Any, int] | None:
        result = self.get(from_stage, to_stage, get_key, metadata)
        if result is None and type(metadata) is dict and ("segment" in metadata or "inline" in metadata):
            # What put() returned names one slot: once that is gone, waiting cannot bring it back.
            raise ConnectorError(
                f"SharedMemoryConnector: {_where(from_stage, to_stage, get_key)} is gone: stale, already "
                "consumed, cleaned up, or its producer died"
            )
        return result

    def _get_by_key(self, from_stage: str, to_stage: str, get_key: str) -> tuple[Any, int] | None:
        """Find the payload in the cells and the key index of every pool on this host (shm_cells,
        shm_index); None if none has it."""
        digest = _digest(from_stage, to_stage, get_key)
        for name in self._pool_names():
            try:
                mm = self._mapped.get(name) or self._mapping(name, from_stage, to_stage, get_key)
            except ConnectorError:
                continue  # another user's segment, or one being torn down
            if mm is None:
                continue
            found = [(name, mm, offset, None) for offset in shm_cells.find(mm, digest)]
            for generation, offset, segment in shm_index.lookup(mm, POOL_HEADER, digest):
                where = name if segment == 0 else f"{name}_x{segment}"
                target = mm if segment == 0 else self._mapping(where, from_stage, to_stage, get_key)
                if target is not None:
                    found.append((where, target, offset, generation))
            for where, target, offset, generation in found:
                if offset + SLOT_HEADER > len(target):
                    continue
                if generation is None:  # a cell: its header holds the generation
                    generation = _GENERATION.unpack_from(target, offset + 16)[0]
                length = _GENERATION.unpack_from(target, offset + 40)[0]
                metadata = {"segment": where, "offset": offset, "generation": generation, "length": length}
                result = self.get(from_stage, to_stage, get_key, metadata)
                if result is not None:
                    return result
        return None

    def _pool_names(self) -> list[str]:
        """This process's pool first, then every other producer's pool on the host (one-off segments
        are found through their pool's index)."""
        own = [self._pool.name] if self._pool is not None else []
        return own + [name for name in list_segments() if "_x" not in name and name not in own]

    def _own_exports(self, name: str, offset: int) -> list[Any] | None:
        """The CUDA tensors of a payload this process put itself (its IPC handles cannot be opened here)."""
        if name not in self._own:
            return None
        slot = self._slots.get((name, offset))
        return [exported.tensor for exported in slot.exports] if slot is not None and slot.exports else None

    def _get_inline(self, from_stage: str, to_stage: str, get_key: str, metadata: dict, inline: Any) -> Any:
        if metadata.get("key") != edge_key(from_stage, to_stage, get_key):
            return self._stale()  # metadata of another key or edge: never hand out its data
        parts = metadata.get("parts")
        try:
            data = codec.decode_parts(inline, parts)
        except codec.FrameError as exc:
            self._counters.add("errors")
            where = _where(from_stage, to_stage, get_key)
            raise ConnectorError(f"SharedMemoryConnector: bad inline payload for {where}: {exc}") from None
        size = len(inline) + sum(map(len, parts))
        self._counters.add_pair("gets", "bytes_got", size)
        return data, size

    def _get_framed(self, from_stage: str, to_stage: str, get_key: str, metadata: dict, framed: Any) -> Any:
        """A tiny payload's frame from the metadata; its copy in the pool (there for gets by key) is
        released. The metadata holds the whole payload, so a get with it always succeeds, as vllm-omni's
        inline payloads do: the coordinator retries a stage whose replica died after its get, with the
        same metadata, and the retry must find its input."""
        if metadata.get("key") != edge_key(from_stage, to_stage, get_key) or type(framed) is not bytes:
            return self._stale()  # metadata of another key or edge: never hand out its data
        self._take_copy(from_stage, to_stage, get_key, metadata)
        try:
            data = codec.decode(framed)
        except codec.FrameError as exc:
            self._counters.add("errors")
            where = _where(from_stage, to_stage, get_key)
            raise ConnectorError(f"SharedMemoryConnector: bad inline payload for {where}: {exc}") from None
        size = len(framed)
        self._counters.add_pair("gets", "bytes_got", size)
        return data, size

    def _take_copy(self, from_stage: str, to_stage: str, get_key: str, metadata: dict) -> bool:
        """Release the pool copy of an inline payload (put for gets by key); False if someone else
        took it or it was freed. A producer that is gone took its copy along: the inline data stands."""
        name, offset, generation = metadata.get("segment"), metadata.get("offset"), metadata.get("generation")
        if type(name) is not str or type(offset) is not int or type(generation) is not int or offset < 0:
            return False
        mm = self._mapped.get(name) or self._mapping(name, from_stage, to_stage, get_key)
        if mm is None:
            return True
        if offset + SLOT_HEADER > len(mm):
            return False
        # Generations are unique within a producer: with the segment they name this one put.
        state, slot_generation = _STATE_AND_GENERATION.unpack_from(mm, offset)
        if state != WRITTEN or slot_generation != generation:
            return False
        mm[offset] = RELEASED
        return True

    def _stale(self) -> None:
        self._counters.add("stale_gets")
        return None

    def _mapping(self, name: str, from_stage: str, to_stage: str, get_key: str) -> mmap.mmap | None:
        own = self._own.get(name)
        if own is not None:
            return own.mm
        mm = self._mapped.get(name)
        if mm is None:
            try:
                mm = open_segment(name)
            except FileNotFoundError:
                return None  # the producer is gone or the payload was reclaimed
            except (ValueError, OSError) as exc:
                where = _where(from_stage, to_stage, get_key)
                raise ConnectorError(f"SharedMemoryConnector: cannot map segment for {where}: {exc}") from None
            if "_x" not in name:  # a producer's pool: map it once. Fallback names end in _x<n>.
                with self._lock:
                    self._forget_unlinked_locked()
                    self._mapped[name] = mm
            # A one-off fallback segment is not kept: the views' release finalizer holds the mapping,
            # so it is unmapped (and its memory returned) once they die and the producer unlinks it.
        return mm

    def _forget_unlinked_locked(self) -> None:
        """Drop cached pools whose producer has closed or been reaped (checked when a new pool appears)."""
        for name in [name for name in self._mapped if not (SHM_DIR / name).exists()]:
            del self._mapped[name]  # live views keep their mapping through their finalizer

    # ------------------------------------------------------------------ lifecycle

    def health(self) -> dict:
        counters = self._counters.snapshot()
        with self._lock:
            pool = self._pool
            pool_size = pool.allocator.size - (self._pool_start - POOL_HEADER) if pool else 0  # less index, cells
            in_use = pool.allocator.in_use if pool else 0
            # Released slots wait for the next put to reclaim them: they hold no payload any more.
            live = sum(1 for slot in self._slots.values() if slot.segment.mm[slot.offset] != RELEASED)
            live += len(self._cells) if self._cells is not None else 0
        status = (
            "unhealthy"
            if self._closed
            else "degraded"
            if pool_size and in_use > 0.9 * pool_size
            else "healthy"
        )
        return {
            "status": status,
            **counters,
            **self._put_health(),
            "pool_size": pool_size,
            "pool_in_use": in_use,
            "live_payloads": live,
        }

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            # Puts write through raw addresses: unmapping under one of them would crash the process.
            if not self._idle.wait_for(lambda: not self._writing, timeout=CLOSE_WAIT_S):
                return  # a put is stuck mid-copy: leave the mappings to process exit rather than crash
            # A forked child closes its inherited copy, but the segments belong to its parent.
            owner = os.getpid() == self._identity.pid
            for slot in self._slots.values():
                if slot.exports and owner and not slot.segment.mm.closed:
                    self._drop_exports_locked(slot)
            for segment in self._own.values():
                if owner:
                    unlink_segment(segment.name)
                with contextlib.suppress(BufferError):
                    segment.mm.close()
            self._own.clear()
            self._slots.clear()
            self._pool = None
            self._cells = None
            self._mapped.clear()  # mappings with live views stay alive until those views die

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()
