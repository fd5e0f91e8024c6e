"""SharedMemoryConnector's tiny payloads (frames up to `inline_max_bytes`): in the metadata, and in the pool.

A tiny payload travels in its metadata as its whole frame (`frame`). A copy goes into one of the
first segment's cells (shm_cells) or, with every cell waiting, a pool slot, where a get by key alone
finds it; the get with the metadata releases that copy. With the pool full it travels in the
metadata only, in the parts form (`inline`, `parts`). The metadata holds the whole payload, so a get
with it always succeeds, as vllm-omni's inline payloads do: the coordinator retries a stage whose
replica died after its get, with the same metadata, and the retry must find its input.
"""

from __future__ import annotations

from typing import Any

from omni_mesh import codec
from omni_mesh.connectors import shm_cells
from omni_mesh.connectors.base import ConnectorError, Counters, edge_key
from omni_mesh.connectors.shm_maps import Mappings
from omni_mesh.connectors.shm_pool import ShmPool
from omni_mesh.connectors.shm_slots import (
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


class TinyPayloads:
    """The producer side of tiny payloads over one pool (module docstring)."""

    def __init__(self, pool: ShmPool, counters: Counters, inline_max_bytes: int) -> None:
        self._pool = pool
        self._counters = counters
        self.cell_size = shm_cells.cell_size(SLOT_HEADER, inline_max_bytes)
        self._cell_frame_bytes = self.cell_size - SLOT_HEADER if self.cell_size else -1
        self.cells: shm_cells.Cells | None = None

    @property
    def reserved(self) -> int:
        """Bytes the cells take in the first segment."""
        return shm_cells.COUNT * self.cell_size

    def lay_out_locked(self, segment: Segment, start: int) -> None:
        """The cells at `start` of the first segment, described in its header for consumers."""
        self.cells = shm_cells.Cells(segment.mm, start, self.cell_size, reusable=(RELEASED,))
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

    def put(self, key: str, put_key: str, frame: codec.FramePlan) -> tuple[int, dict] | None:
        """(size, metadata) of a tiny put laid into a free cell, the frame in the metadata too; `key` is
        its edge key. None when every cell waits for its consumer: then `spill` it.

        Cells are not entered in the key index: a get by key scans them (there are few), which keeps
        this, the path of every tiny put, to one lock and two copies."""
        size = frame.nbytes
        if size > self._cell_frame_bytes:
            return None
        pool = self._pool
        with pool.lock:
            if pool.closed:
                raise ConnectorError(f"SharedMemoryConnector is closed (put of {key!r})")
            first = pool.first_locked()
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
        # The state byte goes last: a consumer never sees WRITTEN before the frame is complete.
        SLOT.pack_into(mm, offset, TAKEN, 0, 0, generation, digest_of(key), size)
        mm[offset] = WRITTEN
        return size, {"segment": first.name, "offset": offset, "generation": generation, "frame": framed, "key": key}

    def clean_locked(self, key: str) -> None:
        if self.cells is not None:
            self.cells.clean(key, waiting=WRITTEN, free=FREE)

    def waiting_locked(self) -> int:
        """Cells holding a payload nobody has released yet."""
        return len(self.cells) if self.cells is not None else 0


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
            _release_copy(metadata, maps, from_stage, to_stage, get_key)
            data, size = codec.decode(framed), len(framed)
        else:
            inline, parts = metadata.get("inline"), metadata.get("parts")
            data = codec.decode_parts(inline, parts)
            size = len(inline) + sum(map(len, parts))
    except codec.FrameError as exc:
        counters.add("errors")
        where = f"key {get_key!r} on edge {from_stage}->{to_stage}"
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
    mm = maps.get(name) or maps.map(name, f"key {get_key!r} on edge {from_stage}->{to_stage}")
    if mm is None:
        return True
    if not 0 <= offset <= len(mm) - SLOT_HEADER:
        return False
    # Generations are unique within a producer: with the segment they name this one put.
    if STATE_AND_GENERATION.unpack_from(mm, offset) != (WRITTEN, generation):
        return False
    mm[offset] = RELEASED
    return True
