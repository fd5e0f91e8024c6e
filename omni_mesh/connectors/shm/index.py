"""The key index of a SharedMemoryConnector pool: a consumer finds a payload by edge and key alone.

vllm-omni calls `get` without metadata (its chunk adapter, its KV receive path), so a payload must be
findable from `from->to/key` by any process on the host. Each producer's pool keeps, right after its
64-byte header, a table of ENTRIES entries of 32 bytes, little-endian:

    digest 16 bytes (blake2b of the edge key, as in the slot header), generation u64,
    slot offset u32, segment u32 (0: the pool itself; n: the producer's one-off segment "<pool>_x<n>")

Only the producer writes it, under its lock, and an entry is only a hint: the consumer checks the slot
header it points to (state, generation, digest, length) exactly as for metadata from a put, so a torn
or stale entry reads as "not there". An entry is placed in the first of PROBE positions from the
digest's bucket that holds the same digest or no live payload; with all PROBE taken by live payloads
the payload is not indexed (its metadata still works; `unindexed_puts` counts it).
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterator
from typing import Any

ENTRY = struct.Struct("<16sQII")
ENTRIES = 4096
PROBE = 8
INDEX_BYTES = ENTRY.size * ENTRIES  # 128 KiB
_EMPTY = bytes(16)


def _positions(digest: bytes) -> Iterator[int]:
    bucket = int.from_bytes(digest[:4], "little") % ENTRIES
    return ((bucket + i) % ENTRIES for i in range(PROBE))


def place(
    mm: Any, start: int, digest: bytes, generation: int, offset: int, segment: int, live: Callable[[int], bool]
) -> int | None:
    """Write the entry for one payload; its position, or None when every probe holds a live payload.
    `live(position)` says whether the entry there still names a payload that can be taken."""
    chosen = int.from_bytes(digest[:4], "little") % ENTRIES
    at = start + chosen * ENTRY.size
    if mm[at : at + 16] != digest and live(chosen):  # taken: probe on (usually one look does)
        chosen = None
        for position in _positions(digest):
            at = start + position * ENTRY.size
            if mm[at : at + 16] == digest:
                chosen = position  # a payload of the same edge and key: the newest put wins
                break
            if chosen is None and not live(position):
                chosen = position
        if chosen is None:
            return None
        at = start + chosen * ENTRY.size
    ENTRY.pack_into(mm, at, _EMPTY, generation, offset, segment)
    mm[at : at + 16] = digest  # the digest last: a reader never matches a half-written entry
    return chosen


def clear(mm: Any, start: int, position: int) -> None:
    at = start + position * ENTRY.size
    mm[at : at + 16] = _EMPTY


def lookup(mm: Any, start: int, digest: bytes) -> list[tuple[int, int, int]]:
    """(generation, offset, segment) of every entry with this digest (normally one)."""
    if len(mm) < start + INDEX_BYTES:
        return []
    found = []
    for position in _positions(digest):
        got, generation, offset, segment = ENTRY.unpack_from(mm, start + position * ENTRY.size)
        if got == digest:
            found.append((generation, offset, segment))
    return found
