"""SharedMemoryConnector's producer side: a put laid into the pool, and what answers for it.

A payload's frame is laid straight into a pool slot (`shm.pool`), marked WRITTEN and entered in the
key index (`lookup.KeyIndex`) so that a get by key finds it. Tiny payloads travel in the metadata
(`shm.tiny`); payloads holding `empty()` outputs are sent where they lie (`shm.outputs`); payloads with
CUDA tensors pass them by IPC handle, held by their slot until the consumer has mapped them.
The producer owns the pool and, with it, the mappings a consumer in this process uses (`Mappings`):
its own segments are never mapped twice.
"""

from __future__ import annotations

import functools
from typing import Any

from omni_mesh import codec, cuda_ipc
from omni_mesh.connectors.counters import Counters
from omni_mesh.connectors.keys import edge_key
from omni_mesh.connectors.shm import cells as shm_cells
from omni_mesh.connectors.shm import index as shm_index
from omni_mesh.connectors.shm import lookup
from omni_mesh.connectors.shm.maps import Mappings
from omni_mesh.connectors.shm.outputs import PoolOutputs
from omni_mesh.connectors.shm.pool import ShmPool
from omni_mesh.connectors.shm.segments import ProcessIdentity
from omni_mesh.connectors.shm.slots import (
    FREE,
    POOL_HEADER,
    SLOT,
    SLOT_HEADER,
    WRITTEN,
    Segment,
    Slot,
    digest,
)
from omni_mesh.connectors.shm.tiny import FrameBytes, TinyPayloads

POOL_RESERVED = shm_index.INDEX_BYTES  # the first segment: header, key index, tiny-payload cells, slots

# What a put answers: (bytes, metadata).
Put = tuple[int, dict]


class ShmProducer:
    """Puts into this process's pool (module docstring). One lock (`lock`, the pool's) guards slots,
    segments, the key index and the cells."""

    def __init__(self, cfg: Any, identity: ProcessIdentity, counters: Counters) -> None:
        self.cfg = cfg
        self._counters = counters
        self.pool = ShmPool(
            cfg,
            identity,
            counters,
            reserved=POOL_RESERVED + shm_cells.COUNT * shm_cells.cell_size(SLOT_HEADER, cfg.inline_max_bytes),
            on_first=self._lay_out_first,
            on_released=self._forget_segment,
            before_reclaim=lambda: self.outputs.drain_locked(),
        )
        self.lock = self.pool.lock
        self.index = lookup.KeyIndex(counters, self.pool.slots)
        self.outputs = PoolOutputs(self.pool, counters)
        # A tiny payload put before gets by key were wanted goes into a slot if no cell is free (shm_tiny).
        copy_to_slot = functools.partial(self.write_frame, pool_only=True)
        self.tiny = TinyPayloads(self.pool, counters, cfg.inline_max_bytes, copy_to_slot)
        self.maps = Mappings(self.pool.own, self.lock)

    def _lay_out_first(self, segment: Segment) -> None:
        """The first segment's start: the key index (zeroed by creation), then the cells (lock held)."""
        self.tiny.lay_out_locked(segment, POOL_HEADER + POOL_RESERVED)
        self.maps.add_locked(segment.name, segment.mm)  # so that gets in this process find it at once

    def _forget_segment(self, segment: Segment) -> None:
        """A grown segment goes back (lock held): no index entry may point into it any more."""
        self.index.forget_locked(self.pool.first, segment)
        self.maps.drop_locked(segment.name)

    def put(self, from_stage: str, to_stage: str, put_key: str, data: Any) -> Put:
        outputs = self.outputs
        if outputs.unsent and type(data) is dict:  # a dict of empty() tensors: no frame to plan
            sent = outputs.put(from_stage, to_stage, put_key, data, None)
            if sent is not None:
                return sent
        frame = codec.plan_flat(data)  # the usual payload: no device policy to make per put
        if frame is None:
            policy = codec.CudaIpcExports() if self.cfg.cuda_ipc else None
            frame = codec.plan(data, device=policy)
            if policy and policy.exports:
                return self.put_with_exports(from_stage, to_stage, put_key, frame, policy.exports)
        if outputs.unsent:
            sent = outputs.put(from_stage, to_stage, put_key, data, frame)
            if sent is not None:
                return sent
        if frame.payload_bytes <= self.cfg.inline_max_bytes:
            return self._put_inline(from_stage, to_stage, put_key, frame)
        _, metadata = self.write_frame(from_stage, to_stage, put_key, frame)
        self._counters.add_pair("puts", "bytes_put", frame.nbytes)
        return frame.nbytes, metadata

    def _put_inline(self, from_stage: str, to_stage: str, put_key: str, frame: codec.FramePlan) -> Put:
        """A tiny payload: in the metadata, with a copy in the pool for gets by key (shm_tiny)."""
        key = edge_key(from_stage, to_stage, put_key)
        put = self.tiny.put(from_stage, to_stage, put_key, key, frame)
        if put is None:
            written = self.write_frame(from_stage, to_stage, put_key, frame, pool_only=True)
            put = self.tiny.spill(key, frame, written)
        size, metadata = put
        self._counters.add_pair("puts", "bytes_put", size, "inline_puts")
        return size, metadata

    def put_with_exports(
        self,
        from_stage: str,
        to_stage: str,
        put_key: str,
        frame: codec.FramePlan,
        exports: list[cuda_ipc.Exported],
    ) -> Put:
        """A payload with CUDA tensors always takes a slot: the slot holds the exported tensors until the
        consumer has mapped them (or the payload is freed unconsumed, which gives their references back)."""
        try:
            _, metadata = self.write_frame(from_stage, to_stage, put_key, frame, exports)
        except BaseException:
            for exported in exports:
                exported.release_unmapped()
            raise
        self._counters.add_pair("puts", "bytes_put", frame.nbytes)
        self._counters.add("cuda_ipc_tensors", len(exports))
        return frame.nbytes, metadata

    def write_frame(
        self,
        from_stage: str,
        to_stage: str,
        put_key: str,
        frame: codec.FramePlan | FrameBytes,
        exports: list[cuda_ipc.Exported] | None = None,
        *,
        pool_only: bool = False,
    ) -> tuple[Slot, dict] | None:
        """Lay the frame into a slot, WRITTEN and in the key index: (the slot, its metadata); with
        `pool_only`, None where the pool's segments have no room."""
        size = frame.nbytes
        where = f"put {put_key!r} on {from_stage}->{to_stage}"
        slot = self.pool.allocate(size, put_key, where, pool_only=pool_only)
        if slot is None:
            return None
        segment, offset, generation = slot.segment, slot.offset, slot.generation
        try:
            frame.write_at(segment.address + offset + SLOT_HEADER)
            slot.exports = exports  # from here on the slot answers for them (a failure above: the caller)
            mm = segment.mm
            # The state byte goes last: a consumer never sees WRITTEN before the frame is complete.
            key_digest = digest(from_stage, to_stage, put_key)
            SLOT.pack_into(mm, offset, FREE, 0, 0, generation, key_digest, size)
            mm[offset] = WRITTEN
            with self.lock:
                first = self.pool.first
                if first is not None:
                    self.index.enter_locked(first, slot, key_digest)
        finally:
            self.pool.done_writing(slot)
        return slot, {"segment": segment.name, "offset": offset, "generation": generation, "length": size}

    def cleanup(self, key: str) -> None:
        with self.lock:
            self.pool.clean_locked(key)
            self.tiny.clean_locked(key)

    def own_exports(self, name: str, offset: int) -> list[Any] | None:
        """The CUDA tensors of a payload this process put itself (its IPC handles cannot be opened here)."""
        if name not in self.pool.own:
            return None
        slot = self.pool.slots.get((name, offset))
        return [exported.tensor for exported in slot.exports] if slot is not None and slot.exports else None
