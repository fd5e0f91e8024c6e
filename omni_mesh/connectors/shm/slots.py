"""The slot protocol of SharedMemoryConnector's segments: what producers and consumers both read.

Every payload in shared memory sits in a slot: a 64-byte header, then its frame.

    slot header (64 bytes, little-endian): state u8, pad, taker pid u32, taker pidns u32,
                                           generation u64, key digest 16 bytes, frame length u64
    state: FREE -> WRITTEN (producer) -> TAKEN (consumer) -> RELEASED (consumer) -> FREE (producer)

The generation and the digest of `from->to/key` make stale or foreign metadata detectable. A consumer
releases a slot when the last view of its payload is garbage-collected, by writing RELEASED into the
header: ownership needs no message back.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import mmap
import struct
import weakref
from dataclasses import dataclass

import numpy as np

from omni_mesh import cuda_ipc
from omni_mesh.connectors.keys import edge_key
from omni_mesh.connectors.shm.segments import ProcessIdentity, process_gone

SLOT = struct.Struct("<B3xII4xQ16sQ")  # generation at byte 16
SLOT_HEADER = 64
POOL_HEADER = 64
FREE, WRITTEN, TAKEN, RELEASED = 0, 1, 2, 3
TAKER = struct.Struct("<II")
GENERATION = struct.Struct("<Q")
STATE_AND_GENERATION = struct.Struct("<B15xQ")  # the first 24 bytes of a slot header
LENGTH_AT = 40  # where the slot header keeps the frame length


class Segment:
    """One mapped segment of a producer: its pool's first (base 0, number 0), one the pool grew by
    (`_p<n>`, number n) or a one-off (`_x<n>`, no base: outside the pool)."""

    __slots__ = ("name", "mm", "base", "address", "number")

    def __init__(self, name: str, mm: mmap.mmap, base: int | None, number: int = 0) -> None:
        self.name = name
        self.mm = mm
        self.base = base  # where its bytes lie in the pool's offset space (pools.slots.SlotPool)
        self.address = address_of(mm)  # valid while mm is open; puts write through it
        self.number = number  # as the key index names it (shm_lookup.segment_number)


def address_of(mm: mmap.mmap) -> int:
    anchor = ctypes.c_char.from_buffer(mm)
    address = ctypes.addressof(anchor)
    del anchor  # the buffer export must not outlive this call, or mm.close() would fail
    return address


@dataclass(slots=True, eq=False)  # hashed by identity: sets of slots being written
class Slot:
    segment: Segment
    offset: int  # of the slot header; the frame follows it
    generation: int
    put_key: str
    capacity: int  # bytes from offset to the end of its allocation: a later put that fits may reuse it
    exports: list[cuda_ipc.Exported] | None = None  # CUDA tensors the frame passes by IPC handle
    pinned: bool = False  # an empty() tensor of this process still views it: never reuse it


def digest(from_stage: str, to_stage: str, key: str) -> bytes:
    return digest_of(edge_key(from_stage, to_stage, key))


def digest_of(name: str) -> bytes:
    """The 16-byte digest of `from->to/key` that slot headers and the key index carry."""
    return hashlib.blake2b(name.encode(), digest_size=16).digest()


def taker_died(mm: mmap.mmap, offset: int) -> bool:
    """Whether the consumer that took this slot is confirmed gone (only decidable in our own PID
    namespace; a /proc we cannot read says it is not)."""
    pid, pidns = TAKER.unpack_from(mm, offset + 4)
    return pidns == ProcessIdentity.current().pidns and pid != 0 and process_gone(pid)


def ready(mm: mmap.mmap, offset: int, generation: int, length: int, key_digest: bytes) -> bool:
    """Whether the slot holds the payload metadata names, ready to be taken. A slot taken by a consumer
    that died may be taken again: the coordinator retries work whose replica died before producing
    output, and the retry needs the same input."""
    if offset + SLOT_HEADER + length > len(mm):
        return False
    state, _, _, slot_generation, slot_digest, slot_length = SLOT.unpack_from(mm, offset)
    if slot_generation != generation or slot_length != length or slot_digest != key_digest:
        return False
    return state == WRITTEN or (state == TAKEN and taker_died(mm, offset))


def take(mm: mmap.mmap, offset: int, length: int, identity: ProcessIdentity) -> np.ndarray:
    """Mark a ready slot TAKEN by this process; the array over its frame."""
    TAKER.pack_into(mm, offset + 4, identity.pid, identity.pidns)
    mm[offset] = TAKEN
    return np.frombuffer(mm, dtype=np.uint8, count=length, offset=offset + SLOT_HEADER)


def release(mm: mmap.mmap, offset: int, generation: int) -> None:
    """Hand a consumed payload's slot back to its producer."""
    with contextlib.suppress(ValueError):  # the mapping was closed: nothing left to release
        if GENERATION.unpack_from(mm, offset + 16)[0] == generation:
            mm[offset] = RELEASED


# Consumed payloads whose views are alive, by id of the weak reference to the buffer they share. A
# weakref callback costs a fraction of weakref.finalize on the get path; the table keeps each
# reference (and so its callback) alive until it fires.
_HELD: dict[int, tuple[weakref.ref, mmap.mmap, int, int]] = {}


def hold_until_dead(base: np.ndarray, mm: mmap.mmap, offset: int, generation: int) -> None:
    """Release the slot once `base` (and every view of it) is garbage-collected."""
    ref = weakref.ref(base, _views_dead)
    _HELD[id(ref)] = (ref, mm, offset, generation)


def _views_dead(ref: weakref.ref) -> None:
    held = _HELD.pop(id(ref), None)
    if held is not None:
        release(*held[1:])


def metadata_problem(metadata: dict) -> str:
    """What is wrong with the metadata of a payload in a slot, for the error that names it."""
    for field, kind in (("segment", str), ("offset", int), ("generation", int), ("length", int)):
        if field not in metadata:
            return f"lacks {field!r}: {metadata!r}"
        value = metadata[field]
        if type(value) is not kind or (kind is int and value < 0):
            return f"has a bad {field!r} ({value!r})"
    return f"is malformed: {metadata!r}"


def names_a_payload(metadata: object) -> bool:
    """Whether `metadata` is what a put returned (else the payload is looked for by its key)."""
    # Spelled out, not any() over a generator: this runs on every get.
    return type(metadata) is dict and (
        "segment" in metadata or "frame" in metadata or "inline" in metadata or "refs" in metadata
    )
