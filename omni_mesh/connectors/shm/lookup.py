"""Get by key alone for SharedMemoryConnector: payloads entered in their pool's key index, and found
from `from->to/key` by any process on the host.

The key index (shm_index) and the tiny-payload cells (shm_cells) live in a pool's first segment; an
index entry names the segment its slot lies in by number: 0 the first, n a segment the pool grew by
(`<pool>_p<n>`), ONE_OFF | n a one-off segment (`<pool>_x<n>`). A grown segment goes back only once it
holds no slot, and its entries are cleared first, so no entry points into a segment that is gone (a
stale one would still be harmless: the slot header is checked as for metadata from a put).
"""

from __future__ import annotations

import mmap
from collections.abc import Callable, Iterator
from typing import Any

from omni_mesh.connectors.counters import Counters
from omni_mesh.connectors.errors import ConnectorError
from omni_mesh.connectors.shm import cells as shm_cells
from omni_mesh.connectors.shm import index as shm_index
from omni_mesh.connectors.shm import wanted
from omni_mesh.connectors.shm.maps import Mappings
from omni_mesh.connectors.shm.segments import list_segments
from omni_mesh.connectors.shm.slots import (
    GENERATION,
    LENGTH_AT,
    POOL_HEADER,
    SLOT_HEADER,
    TAKEN,
    WRITTEN,
    Segment,
    Slot,
)

ONE_OFF = 1 << 31  # the index's segment number of a one-off segment: ONE_OFF | n for `_x<n>`


def segment_number(segment: Segment) -> int:
    return segment.number if segment.base is not None else ONE_OFF | segment.number


def segment_suffix(number: int) -> str:
    """The name suffix of the segment an index entry names."""
    if number == 0:
        return ""
    return f"_x{number & ~ONE_OFF}" if number & ONE_OFF else f"_p{number}"


def is_first_segment(name: str) -> bool:
    """A pool's first segment (where its index and cells are), not one it grew by or a one-off."""
    return "_x" not in name and "_p" not in name


class KeyIndex:
    """The producer's entries in its first segment's key index; the caller holds the pool's lock.
    `slots` is the pool's slot table (an entry whose slot left it is free to take)."""

    def __init__(self, counters: Counters, slots: dict[tuple[str, int], Slot]) -> None:
        self._counters = counters
        self._slots = slots
        # index position -> (mapping, offset, generation, slot or None for a cell) of the payload there
        self._entries: dict[int, tuple[mmap.mmap, int, int, Slot | None]] = {}

    def enter_locked(self, first: Segment, slot: Slot, key_digest: bytes) -> None:
        """Enter a written payload, so a get by key finds it."""
        mm, offset, generation = slot.segment.mm, slot.offset, slot.generation
        number = segment_number(slot.segment)
        position = shm_index.place(first.mm, POOL_HEADER, key_digest, generation, offset, number, self._live)
        if position is None:
            self._counters.add("unindexed_puts")
        else:
            self._entries[position] = (mm, offset, generation, slot)

    def _live(self, position: int) -> bool:
        """Whether the entry at `position` still names a payload a consumer may take."""
        occupant = self._entries.get(position)
        if occupant is None:
            return False
        mm, offset, generation, slot = occupant
        if (
            (slot is not None and self._slots.get((slot.segment.name, slot.offset)) is not slot)
            or mm.closed
            or GENERATION.unpack_from(mm, offset + 16)[0] != generation
        ):
            del self._entries[position]
            return False
        return mm[offset] in (WRITTEN, TAKEN)

    def forget_locked(self, first: Segment | None, segment: Segment) -> None:
        """Clear the entries that point into `segment` (it is going back to the system)."""
        for position, (mm, _, _, _) in list(self._entries.items()):
            if mm is segment.mm:
                del self._entries[position]
                if first is not None and not first.mm.closed:
                    shm_index.clear(first.mm, POOL_HEADER, position)


def pool_names(own: str | None) -> list[str]:
    """Every pool on the host whose index may name the payload, this process's own first."""
    first = [own] if own is not None else []
    return first + [name for name in list_segments() if is_first_segment(name) and name != own]


def candidates(
    names: list[str], mapping: Callable[[str], mmap.mmap | None], key_digest: bytes
) -> Iterator[dict]:
    """Metadata of every slot a pool's cells or key index name for `key_digest`, to be tried as a get
    with metadata would (the slot header decides). `mapping(name)` maps a segment or says None."""
    for name in names:
        mm = mapping(name)
        if mm is None:
            continue
        found = [(name, mm, offset, None) for offset in shm_cells.find(mm, key_digest)]
        for generation, offset, number in shm_index.lookup(mm, POOL_HEADER, key_digest):
            where = name + segment_suffix(number)
            target = mm if number == 0 else mapping(where)
            if target is not None:
                found.append((where, target, offset, generation))
        for where, target, offset, generation in found:
            if offset + SLOT_HEADER > len(target):
                continue
            if generation is None:  # a cell: its header holds the generation
                generation = GENERATION.unpack_from(target, offset + 16)[0]
            length = GENERATION.unpack_from(target, offset + LENGTH_AT)[0]
            yield {"segment": where, "offset": offset, "generation": generation, "length": length}


def find_by_key(
    first: str | None,
    maps: Mappings,
    where: str,
    key_digest: bytes,
    get: Callable[[dict], tuple[Any, int] | None],
) -> tuple[Any, int] | None:
    """A payload found by its key alone in every pool on this host (`first`: this process's own
    first segment), through `get` of each candidate's metadata; None if none has it. Every pool seen
    is flagged, so from now on its tiny puts keep a copy for gets by key (`wanted`)."""

    def mapping(name: str) -> mmap.mmap | None:
        try:
            return maps.get(name) or maps.map(name, where)
        except ConnectorError:
            return None  # another user's segment, or one being torn down

    names = pool_names(first)
    for name in names:
        mm = mapping(name)
        if mm is not None:
            wanted.mark(mm)
    wanted.tick()  # producers in this process copy their recent tiny payloads in now
    for metadata in candidates(names, mapping, key_digest):
        result = get(metadata)
        if result is not None:
            return result
    return None
