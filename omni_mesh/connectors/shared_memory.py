"""SharedMemoryConnector: payloads between processes on one host, through a pre-faulted pool.

Producer side: a pool of pre-faulted segments per process (`shm.pool`: created on the first put,
grown for payloads that fit no free space up to `max_pool_size`, grown segments returned once idle),
so the steady state creates no segment and takes no page fault. The codec lays each frame straight
into a pool slot. Only past the ceiling does a payload get a one-off segment (counted as a fallback).
Tiny payloads ride in the metadata as their whole frame, with a copy in one of the pool's cells once
some process on the host gets by key alone (shm_tiny).
`empty()` hands out output tensors already in a slot, which a put then sends where they lie
(`shm.outputs`).

Consumer side: `get` maps the producer's segment once (cached) and decodes tensors and arrays as
views over the slot: no copy at all. When the last view is garbage-collected, the consumer marks the
slot released in the slot header (`shm.slots`, the protocol), and the producer reuses the space on
its next put. A get without metadata finds the payload by its key (`lookup`).

The generation and the digest of `from->to/key` make stale or foreign metadata detectable: `get`
then returns None instead of another request's data. A slot taken by a consumer that has died is
reclaimed when the pool runs short.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from omni_mesh import codec, cuda_ipc
from omni_mesh.connectors.base import ConnectorError, Counters, OmniConnectorBase, edge_key
from omni_mesh.connectors.config import SharedMemoryConfig
from omni_mesh.connectors.errors import ConnectorClosed
from omni_mesh.connectors.pools.growth import AUTO_CEILING_MAX, GROW_STEP
from omni_mesh.connectors.shm import cells as shm_cells
from omni_mesh.connectors.shm import index as shm_index
from omni_mesh.connectors.shm import lookup
from omni_mesh.connectors.shm import tiny as shm_tiny
from omni_mesh.connectors.shm.lifecycle import SharedMemoryLifecycle
from omni_mesh.connectors.shm.maps import Mappings
from omni_mesh.connectors.shm.outputs import PoolOutputs, get_parts
from omni_mesh.connectors.shm.pool import ShmPool
from omni_mesh.connectors.shm.segments import ProcessIdentity, new_token
from omni_mesh.connectors.shm.slots import (
    FREE,
    POOL_HEADER,
    SLOT,
    SLOT_HEADER,
    WRITTEN,
    Segment,
    Slot,
    digest,
    hold_until_dead,
    metadata_problem,
    names_a_payload,
    ready,
    take,
)
from omni_mesh.connectors.shm.tiny import FrameBytes, TinyPayloads

__all__ = ["AUTO_CEILING_MAX", "GROW_STEP", "SharedMemoryConfig", "SharedMemoryConnector"]

# health() counters (the pool counts fallbacks, growth and errors; shm_outputs zero_copy_leaves).
_COUNTERS = ("puts", "gets", "bytes_put", "bytes_got", "inline_puts", "fallbacks", "stale_gets", "errors")
_COUNTERS += ("cuda_ipc_tensors", "unindexed_puts", "pool_grown", "pool_released", "zero_copy_leaves")
POOL_RESERVED = shm_index.INDEX_BYTES  # the first segment: header, key index, tiny-payload cells, slots


def _where(from_stage: str, to_stage: str, key: str) -> str:
    return f"key {key!r} on edge {from_stage}->{to_stage}"


class SharedMemoryConnector(OmniConnectorBase):
    config_class = SharedMemoryConfig
    scope = "host"
    lifecycle = SharedMemoryLifecycle

    def __init__(self, config: dict[str, Any] | None = None) -> None:
        super().__init__(config)
        self._identity = ProcessIdentity.current()
        self._counters = Counters(*_COUNTERS)
        self._pool = ShmPool(
            self.config,
            self._identity,
            new_token(),
            self._counters,
            reserved=POOL_RESERVED
            + shm_cells.COUNT * shm_cells.cell_size(SLOT_HEADER, self.config.inline_max_bytes),
            on_first=self._lay_out_first,
            on_released=self._forget_segment,
            before_reclaim=self._drain_outputs,
        )
        self._lock = self._pool.lock  # one lock: slots, segments, key index, cells
        self._index = lookup.KeyIndex(self._counters, self._pool.slots)
        self._outputs = PoolOutputs(self._pool, self._counters)
        self._tiny = TinyPayloads(self._pool, self._counters, self.config.inline_max_bytes, self._copy_to_slot)
        self._maps = Mappings(self._pool.own, self._lock)

    @property
    def _closed(self) -> bool:
        return self._pool.closed

    def _lay_out_first(self, segment: Segment) -> None:
        """The first segment's start: the key index (zeroed by creation), then the cells (lock held)."""
        self._tiny.lay_out_locked(segment, POOL_HEADER + POOL_RESERVED)
        self._maps.add_locked(segment.name, segment.mm)  # so that gets in this process find it at once

    def _forget_segment(self, segment: Segment) -> None:
        """A grown segment goes back (lock held): no index entry may point into it any more."""
        self._index.forget_locked(self._pool.first, segment)
        self._maps.drop_locked(segment.name)

    def _drain_outputs(self) -> None:
        self._outputs.drain_locked()

    # ------------------------------------------------------------------ producer side

    def _put(self, from_stage: str, to_stage: str, put_key: str, data: Any) -> tuple[bool, int, dict | None]:
        outputs = self._outputs
        if outputs.unsent and type(data) is dict:  # a dict of empty() tensors: no frame to plan
            sent = outputs.put(from_stage, to_stage, put_key, data, None)
            if sent is not None:
                return sent
        frame = codec.plan_flat(data)  # the usual payload: no device policy to make per put
        if frame is None:
            policy = codec.CudaIpcExports() if self.config.cuda_ipc else None
            frame = codec.plan(data, device=policy)
            if policy and policy.exports:
                return self._put_with_exports(from_stage, to_stage, put_key, frame, policy.exports)
        if outputs.unsent:
            sent = outputs.put(from_stage, to_stage, put_key, data, frame)
            if sent is not None:
                return sent
        if frame.payload_bytes <= self.config.inline_max_bytes:
            return self._put_inline(from_stage, to_stage, put_key, frame)
        return self._put_frame(from_stage, to_stage, put_key, frame)

    def empty(self, shape: tuple[int, ...] | list[int], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialized tensor in a pool slot of its own: returned in a put's payload, it is sent
        where it lies (shm_outputs). Do not write into it after the put."""
        return self._outputs.empty(tuple(int(n) for n in shape), dtype)

    def _put_inline(
        self, from_stage: str, to_stage: str, put_key: str, frame: codec.FramePlan
    ) -> tuple[bool, int, dict]:
        """A tiny payload: in the metadata, with a copy in the pool for gets by key (shm_tiny)."""
        key = edge_key(from_stage, to_stage, put_key)
        put = self._tiny.put(from_stage, to_stage, put_key, key, frame)
        if put is None:
            put = self._tiny.spill(key, frame, self._write_frame(from_stage, to_stage, put_key, frame, pool_only=True))
        size, metadata = put
        self._count_put(size, "inline_puts")
        return True, size, metadata

    def _put_with_exports(
        self,
        from_stage: str,
        to_stage: str,
        put_key: str,
        frame: codec.FramePlan,
        exports: list[cuda_ipc.Exported],
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
    ) -> tuple[bool, int, dict]:
        _, metadata = self._write_frame(from_stage, to_stage, put_key, frame, exports)
        self._count_put(frame.nbytes)
        return True, frame.nbytes, metadata

    def _copy_to_slot(
        self, from_stage: str, to_stage: str, put_key: str, frame: FrameBytes
    ) -> tuple[Slot, dict] | None:
        """A tiny payload put before gets by key were wanted, copied into a slot (shm_tiny)."""
        return self._write_frame(from_stage, to_stage, put_key, frame, pool_only=True)

    def _write_frame(
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
        slot = self._pool.allocate(size, put_key, where, pool_only=pool_only)
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
            with self._lock:
                first = self._pool.first
                if first is not None:
                    self._index.enter_locked(first, slot, key_digest)
        finally:
            self._pool.done_writing(slot)
        return slot, {"segment": segment.name, "offset": offset, "generation": generation, "length": size}

    def warm_up(self) -> None:
        with self._lock:
            self._pool.first_locked()

    def _count_put(self, size: int, extra: str | None = None) -> None:
        self._counters.add_pair("puts", "bytes_put", size, extra)

    def reap_consumed(self) -> None:
        """Free the slots consumers have released (and those taken by consumers that died) now, rather
        than at the next put that needs room."""
        with self._lock:
            if not self._closed and self._pool.slots:
                self._pool.reclaim_locked(check_takers=True)

    def cleanup(self, key: str) -> None:
        """Free what this process put under `key` (or `key/...`) that no consumer holds."""
        with self._lock:
            self._pool.clean_locked(key)
            self._tiny.clean_locked(key)

    # ------------------------------------------------------------------ consumer side

    def get(
        self, from_stage: str, to_stage: str, get_key: str, metadata: dict | None = None
    ) -> tuple[Any, int] | None:
        if self._closed:
            raise ConnectorClosed(
                f"SharedMemoryConnector is closed (get of {_where(from_stage, to_stage, get_key)})"
            )
        if type(metadata) is dict and metadata.get("frame") is not None:  # a tiny payload: the usual get
            got = shm_tiny.get(from_stage, to_stage, get_key, metadata, self._maps, self._counters)
            return got if got is not None else self._stale()
        if not names_a_payload(metadata):
            return self._get_by_key(from_stage, to_stage, get_key)  # no (or partial) metadata: the key alone
        if metadata.get("inline") is not None:
            got = shm_tiny.get(from_stage, to_stage, get_key, metadata, self._maps, self._counters)
            return got if got is not None else self._stale()
        if "refs" in metadata:
            return self._get_parts(from_stage, to_stage, get_key, metadata)
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
            raise ConnectorError(f"SharedMemoryConnector: metadata for {where} {metadata_problem(metadata)}")
        mm = self._maps.get(name) or self._maps.map(name, _where(from_stage, to_stage, get_key))
        if mm is None or not ready(mm, offset, generation, length, digest(from_stage, to_stage, get_key)):
            return self._stale()
        base = take(mm, offset, length, self._identity)
        try:
            data = codec.decode(
                base, copy=self.config.copy_on_get, cuda_local=self._own_exports(name, offset)
            )
        except codec.FrameError as exc:
            self._counters.add("errors")
            where = _where(from_stage, to_stage, get_key)
            raise ConnectorError(f"SharedMemoryConnector: bad frame for {where}: {exc}") from None
        except cuda_ipc.CudaIpcUnavailable as exc:
            self._counters.add("errors")
            where = _where(from_stage, to_stage, get_key)
            raise ConnectorError(
                f"SharedMemoryConnector: cannot map the CUDA tensors of {where}: {exc}"
            ) from None
        finally:
            # With views alive, the slot goes back when they die; otherwise right now.
            hold_until_dead(base, mm, offset, generation)
            del base
        self._counters.add_pair("gets", "bytes_got", length)
        return data, length

    def _wait_once(
        self, from_stage: str, to_stage: str, get_key: str, metadata: dict | None, deadline: float
    ) -> tuple[Any, int] | None:
        result = self.get(from_stage, to_stage, get_key, metadata)
        if result is None and names_a_payload(metadata):
            # What put() returned names its slots: once they are gone, waiting cannot bring them back.
            raise ConnectorError(
                f"SharedMemoryConnector: {_where(from_stage, to_stage, get_key)} is gone: stale, already "
                "consumed, cleaned up, or its producer died"
            )
        return result

    def _get_parts(
        self, from_stage: str, to_stage: str, get_key: str, metadata: dict
    ) -> tuple[Any, int] | None:
        """A payload holding empty() outputs (shm_outputs): views over each of its slots."""
        if metadata.get("key") != edge_key(from_stage, to_stage, get_key):
            return self._stale()  # metadata of another key or edge: never hand out its data
        where = _where(from_stage, to_stage, get_key)
        mapping = self._maps.mapper(where)
        try:
            got = get_parts(
                metadata,
                where,
                digest(from_stage, to_stage, get_key),
                mapping,
                self._identity,
                self.config.copy_on_get,
            )
        except ConnectorError:
            self._counters.add("errors")
            raise
        if got is None:
            return self._stale()
        self._counters.add_pair("gets", "bytes_got", got[1])
        return got

    def _get_by_key(self, from_stage: str, to_stage: str, get_key: str) -> tuple[Any, int] | None:
        """Find the payload in the cells and the key index of every pool on this host (lookup);
        None if none has it."""
        first = self._pool.first
        return lookup.find_by_key(
            first.name if first is not None else None,
            self._maps,
            _where(from_stage, to_stage, get_key),
            digest(from_stage, to_stage, get_key),
            lambda metadata: self.get(from_stage, to_stage, get_key, metadata),
        )

    def _own_exports(self, name: str, offset: int) -> list[Any] | None:
        """The CUDA tensors of a payload this process put itself (its IPC handles cannot be opened here)."""
        if name not in self._pool.own:
            return None
        slot = self._pool.slots.get((name, offset))
        return [exported.tensor for exported in slot.exports] if slot is not None and slot.exports else None

    def _stale(self) -> None:
        self._counters.add("stale_gets")
        return None

    # ------------------------------------------------------------------ lifecycle

    def health(self) -> dict:
        pool = self._pool
        with self._lock:
            if not self._closed:
                self._outputs.drain_locked()
                pool.release_idle_locked()
                self._maps.forget_unlinked_locked()  # a consumer lets go of segments their producer gave back
            pool_size, in_use, segments, live, near_ceiling = pool.usage_locked()
            tiny_copies = self._tiny.waiting_locked()
            live += tiny_copies
        status = "unhealthy" if self._closed else "degraded" if near_ceiling else "healthy"
        return {
            "status": status,
            **self._counters.snapshot(),  # after the release above, which it counts
            **self._put_health(),
            "pool_size": pool_size,
            "pool_in_use": in_use,
            "pool_segments": segments,
            "max_pool_size": pool.ceiling,
            "live_payloads": live,
            # Of those, tiny payloads copied into the pool for a get by key (a get by key in any
            # process on the host asks for them; untaken copies go after 30 s).
            "tiny_copies": tiny_copies,
        }

    def close(self) -> None:
        if not self._pool.close():
            return  # a put is stuck mid-copy: leave the mappings to process exit rather than crash
        with self._lock:
            self._tiny.close_locked()
            self._maps.clear_locked()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()
