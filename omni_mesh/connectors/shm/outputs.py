"""Outputs allocated in a SharedMemoryConnector's pool: `empty(shape, dtype)` and the puts of them.

`empty()` hands out a tensor over a pool slot of its own (not yet WRITTEN). A put whose payload holds
such tensors as leaves sends them where they lie: the metadata carries the payload in the parts form
(the codec header, each leaf either a few inline bytes or a reference to a slot), and the consumer
decodes views over those slots, each released like any other. While the producer's tensor lives its
slot is pinned: never refilled under it, even once consumed. When the tensor dies, a slot never put
(or consumed and released) is freed; the weakref callback only queues it, the pool frees it under
its lock at the next reclaim.

The metadata travels on the control plane, so it stays small: a payload whose header (its strings,
say a prompt of megabytes) or inline leaves would make it larger than PARTS_METADATA_MAX is not put in
the parts form; the connector puts it as a whole frame instead (its empty() tensors copied).

    metadata {"header": bytes, "refs": [bytes | [segment, offset, generation, length], ...], "key"}
"""

from __future__ import annotations

import collections
import ctypes
import functools
import mmap
import weakref
from typing import TYPE_CHECKING, Any

from omni_mesh import codec
from omni_mesh.codec.frame import contiguous_address
from omni_mesh.connectors.counters import Counters
from omni_mesh.connectors.errors import ConnectorError
from omni_mesh.connectors.keys import edge_key
from omni_mesh.connectors.pools import outputs as _pool_outputs
from omni_mesh.connectors.shm.pool import ShmPool
from omni_mesh.connectors.shm.segments import ProcessIdentity
from omni_mesh.connectors.shm.slots import (
    FREE,
    RELEASED,
    SLOT,
    SLOT_HEADER,
    WRITTEN,
    Slot,
    digest,
    hold_until_dead,
    ready,
    take,
)
from omni_mesh.lazy_torch import import_torch

if TYPE_CHECKING:
    import torch

PART_INLINE_MAX = 1024  # in the parts form, leaves up to this size ride inline in the metadata
PARTS_METADATA_MAX = 64 * 1024  # larger parts-form metadata: the payload goes as a whole frame
_REF_BYTES = 64  # what one slot reference adds to the metadata, at most
UNSENT_KEY = "\0empty()"  # put_key of a slot empty() handed out; no cleanup(key) matches it


def parts_metadata_bytes(header: bytes, lengths: list[int]) -> int:
    """At most how large the parts form's metadata of a payload is: its header and small leaves inline,
    a reference for each other leaf."""
    return len(header) + sum(n if n <= PART_INLINE_MAX else _REF_BYTES for n in lengths)


def _queue_dead(queue: collections.deque, slot: Slot, ref: weakref.ref) -> None:
    """An empty() tensor died: the pool unpins its slot under its lock, later (no lock here: GC may run
    this anywhere)."""
    queue.append((id(ref), slot))


class PoolOutputs:
    """The producer side of empty() outputs over one pool (module docstring)."""

    def __init__(self, pool: ShmPool, counters: Counters) -> None:
        self._pool = pool
        self._counters = counters
        # Slots handed out by empty() and not put yet, by their tensor's address: ((slot, bytes), dtype,
        # shape, kind).
        self.unsent: dict[int, _pool_outputs.Entry] = {}  # owner: (slot, bytes)
        # Weak references to empty() tensors' buffers (kept so their callbacks run), and the slots whose
        # tensors died, queued by those callbacks.
        self._pins: dict[int, weakref.ref] = {}
        self._dead: collections.deque[tuple[int, Slot]] = collections.deque()

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        nbytes = _pool_outputs.nbytes_of(shape, dtype)
        if nbytes < _pool_outputs.MIN_BYTES:
            return import_torch().empty(shape, dtype=dtype)
        slot = self._pool.allocate(nbytes, UNSENT_KEY, "empty()")
        try:
            tensor, base = _pool_outputs.tensor_over(slot.segment.mm, slot.offset + SLOT_HEADER, shape, dtype)
            with self._pool.lock:
                slot.pinned = True
                kind = _pool_outputs.KINDS.of((tensor.dtype, tensor.shape))[0]
                self.unsent[tensor.data_ptr()] = ((slot, nbytes), tensor.dtype, tensor.shape, kind)
                ref = weakref.ref(base, functools.partial(_queue_dead, self._dead, slot))
                self._pins[id(ref)] = ref
        finally:
            self._pool.done_writing(slot)
        return tensor

    def drain_locked(self) -> None:
        """Slots whose empty() tensor died: unpin them, and free those no consumer got (or still holds)."""
        pool = self._pool
        while self._dead:
            ref_id, slot = self._dead.popleft()
            self._pins.pop(ref_id, None)
            slot.pinned = False
            address = slot.segment.address + slot.offset + SLOT_HEADER
            entry = self.unsent.get(address)
            if entry is not None and entry[0][0] is slot:
                del self.unsent[address]
            live = pool.slots.get((slot.segment.name, slot.offset)) is slot and not slot.segment.mm.closed
            if live and slot.segment.mm[slot.offset] in (FREE, RELEASED):
                pool.free_locked(slot)

    # ---- puts

    def put(
        self, from_stage: str, to_stage: str, put_key: str, data: Any, frame: codec.FramePlan | None
    ) -> tuple | None:
        """The put of a payload holding empty() tensors, in the parts form; None when it holds none.
        `frame` None: `data` is a dict, put so where its values are all empty() tensors (a cached header,
        no frame); otherwise `frame` is its plan."""
        with self._pool.lock:
            if frame is None:
                taken = _pool_outputs.take_outputs(data, self.unsent, max_header=PARTS_METADATA_MAX)
                if taken is None:
                    return None
                header, layout, slots, _ = taken
                resident = {index: slots[slot] for index, slot in enumerate(layout) if slot >= 0}
                leaves = [None] * len(layout)
                lengths = [0] * len(layout)
            else:
                if parts_metadata_bytes(frame.header, frame.lengths) > PARTS_METADATA_MAX:
                    return None  # a frame of its own: metadata of a few fields, whatever the payload holds
                resident = _pool_outputs.take_resident(frame, self.unsent)
                if not resident:
                    return None
                header, leaves, lengths = frame.header, frame.leaves, frame.lengths
        return self._put_parts(from_stage, to_stage, put_key, header, leaves, lengths, resident)

    def _put_parts(
        self,
        from_stage: str,
        to_stage: str,
        put_key: str,
        header: bytes,
        leaves: list[Any],
        lengths: list[int],
        resident: dict[int, tuple[Slot, int]],
    ) -> tuple[int, dict]:
        """Resident leaves where they lie, small ones inline, other large ones copied into slots."""
        key_digest = digest(from_stage, to_stage, put_key)
        refs: list[Any] = []
        try:
            for index, leaf in enumerate(leaves):
                found = resident.get(index)
                if found is not None:
                    refs.append(self._seal(*found, put_key, key_digest))
                elif leaf is None or _pool_outputs.is_padding(leaf):
                    refs.append(b"")  # padding: no leaf references it
                elif lengths[index] <= PART_INLINE_MAX:
                    refs.append(bytes(_pool_outputs.leaf_bytes(leaf, lengths[index])))
                else:
                    where = f"put {put_key!r} on {from_stage}->{to_stage}"
                    refs.append(self._copy(leaf, lengths[index], put_key, where, key_digest))
        except BaseException:
            self._abort(refs)
            raise
        self._counters.add("zero_copy_leaves", len(resident))
        size = len(header) + sum(ref[3] if type(ref) is list else len(ref) for ref in refs)
        self._counters.add_pair("puts", "bytes_put", size)
        return size, {"header": header, "refs": refs, "key": edge_key(from_stage, to_stage, put_key)}

    def _seal(self, slot: Slot, length: int, put_key: str, key_digest: bytes) -> list:
        """Hand an empty() slot to the consumer as written (its bytes are the tensor already)."""
        with self._pool.lock:
            slot.put_key = put_key
            mm = slot.segment.mm
            SLOT.pack_into(mm, slot.offset, FREE, 0, 0, slot.generation, key_digest, length)
            mm[slot.offset] = WRITTEN
        return [slot.segment.name, slot.offset, slot.generation, length]

    def _copy(self, leaf: Any, length: int, put_key: str, where: str, key_digest: bytes) -> list:
        slot = self._pool.allocate(length, put_key, where)
        try:
            address = slot.segment.address + slot.offset + SLOT_HEADER
            source = contiguous_address(leaf)
            if source is None:  # strided: through the codec's copy into a buffer first
                buffer = _pool_outputs.leaf_bytes(leaf, length)
                ctypes.memmove(address, (ctypes.c_char * length).from_buffer(buffer), length)
            else:
                ctypes.memmove(address, source, length)
            SLOT.pack_into(slot.segment.mm, slot.offset, FREE, 0, 0, slot.generation, key_digest, length)
            slot.segment.mm[slot.offset] = WRITTEN
        finally:
            self._pool.done_writing(slot)
        return [slot.segment.name, slot.offset, slot.generation, length]

    def _abort(self, refs: list[Any]) -> None:
        """A put in the parts form failed half-way: free the slots it copied leaves into."""
        pool = self._pool
        with pool.lock:
            for ref in refs:
                if type(ref) is list:
                    slot = pool.slots.get((ref[0], ref[1]))
                    if slot is not None and not slot.pinned and slot not in pool.writing:
                        pool.free_locked(slot)


def get_parts(
    metadata: dict,
    where: str,
    key_digest: bytes,
    mapping: Any,
    identity: ProcessIdentity,
    copy: bool,
) -> tuple[Any, int] | None:
    """The consumer side of the parts form: views over each referenced slot, released like any other;
    None when a slot no longer holds what the metadata names. `mapping(name)` maps a segment."""
    header, refs = metadata.get("header"), metadata.get("refs")
    if type(header) is not bytes or type(refs) is not list:
        raise ConnectorError(f"SharedMemoryConnector: metadata for {where} has a bad 'header' or 'refs'")
    located: list[tuple[mmap.mmap, int, int, int]] = []
    for ref in refs:
        if type(ref) is bytes:
            continue
        if (
            type(ref) is not list
            or len(ref) != 4
            or type(ref[0]) is not str
            or any(type(n) is not int or n < 0 for n in ref[1:])
        ):
            raise ConnectorError(f"SharedMemoryConnector: metadata for {where} has a bad part {ref!r}"[:300])
        mm = mapping(ref[0])
        if mm is None or not ready(mm, ref[1], ref[2], ref[3], key_digest):
            return None
        located.append((mm, ref[1], ref[2], ref[3]))
    parts: list[Any] = []
    held = iter(located)
    for ref in refs:
        if type(ref) is bytes:
            parts.append(ref)
            continue
        mm, offset, generation, length = next(held)
        base = take(mm, offset, length, identity)
        hold_until_dead(base, mm, offset, generation)
        parts.append(base)
    try:
        data = codec.decode_parts(header, parts, copy=copy)
    except codec.FrameError as exc:
        raise ConnectorError(f"SharedMemoryConnector: bad payload parts for {where}: {exc}") from None
    finally:
        del parts
    size = len(header) + sum(ref[3] if type(ref) is list else len(ref) for ref in refs)
    return data, size
