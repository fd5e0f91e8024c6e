"""A SharedMemoryConnector producer's pool: its segments and the slots in them.

Where a slot goes, growth and idle release are the one `pools.slots.SlotPool`'s, sized as
`pools.growth` says; each of its regions is a segment here: the first (created on the first put,
with the key index and the tiny-payload cells at its start), those grown (`_p<n>`, pre-faulted, kept
for the next payloads, unlinked once idle `pool_idle_release_s`). Only past the ceiling does a payload
take a one-off segment (`_x<n>`, counted as a fallback), unlinked once it is freed. So the steady
state creates no segment and takes no page fault at any size below the ceiling.

One lock (`lock`) guards the segments and the slot table; the connector holds it for its key index
and cells too. Slots being written are listed in `writing`: cleanup leaves them alone, close waits.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import os
import threading
from collections.abc import Callable
from typing import Any

from omni_mesh.connectors.counters import Counters
from omni_mesh.connectors.errors import ConnectorClosed, ConnectorError, ConnectorFull
from omni_mesh.connectors.keys import cleaned_by
from omni_mesh.connectors.pools import growth as _growth
from omni_mesh.connectors.pools.allocator import PAGE, frame_alignment, round_up
from omni_mesh.connectors.pools.slots import SlotPool
from omni_mesh.connectors.shm.segments import (
    ProcessIdentity,
    create_unique_segment,
    new_number,
    new_token,
    segment_name,
    shm_capacity,
    unlink_segment,
)
from omni_mesh.connectors.shm.slots import (
    FREE,
    GENERATION,
    POOL_HEADER,
    RELEASED,
    SLOT_HEADER,
    TAKEN,
    Segment,
    Slot,
    taker_died,
)

REUSE_SLACK = 2 * PAGE  # a released slot is refilled by a put this much smaller at most
CLOSE_WAIT_S = 30.0


class ShmPool:
    """The producer side's memory (module docstring). `reserved` bytes after the first segment's
    header belong to the connector (key index, cells); `on_first(segment)` lays them out,
    `on_released(segment)` hears of a grown segment going back, `before_reclaim()` runs under the
    lock before released slots are looked for."""

    def __init__(
        self,
        cfg: Any,
        identity: ProcessIdentity,
        counters: Counters,
        *,
        reserved: int,
        on_first: Callable[[Segment], None],
        on_released: Callable[[Segment], None],
        before_reclaim: Callable[[], None],
    ) -> None:
        self.cfg = cfg
        self._identity, self._token, self._counters = identity, new_token(), counters
        self._start = POOL_HEADER + reserved
        self._on_first, self._on_released, self._before_reclaim = on_first, on_released, before_reclaim
        self.lock = threading.Lock()
        self._idle = threading.Condition(self.lock)
        self.ceiling = _growth.ceiling(cfg.memory_pool_size, cfg.max_pool_size, shm_capacity())
        self.segments: dict[int, Segment] = {}  # by base in `_places`: the first (0), those grown
        self._places: SlotPool | None = None  # created with the first segment
        self.slots: dict[tuple[str, int], Slot] = {}
        self.own: dict[str, Segment] = {}  # every segment this process made, one-offs included
        self.writing: set[Slot] = set()
        self.closed = False
        self._generations = itertools.count(1)

    # ---- segments

    @property
    def first(self) -> Segment | None:
        return self.segments.get(0)

    def first_locked(self) -> Segment:
        """The first segment, created (pre-faulted) on first use."""
        if not self.segments:
            size = round_up(self._start + max(_growth.first_part(self.cfg.memory_pool_size, self.ceiling), SLOT_HEADER))
            name, mm = self._create(self._first_name, size, self.cfg.prefault, f"a {size}-byte pool")
            self._places = SlotPool(size, ceiling=self.ceiling, start=self._start)
            segment = self._add_locked(Segment(name, mm, 0))
            self._on_first(segment)
        return self.segments[0]

    def usage_locked(self) -> tuple[int, int, int, int, bool]:
        """For health(): pool bytes (less the header, key index and cells), bytes in use, segments,
        payloads live in slots, and whether use is near the ceiling (over 90%)."""
        places = self._places  # created with the first segment, dropped at close with every slot
        if places is None:
            return 0, 0, 0, 0, False
        size = places.size - self._start
        # Released slots wait for the next put to reclaim them: they hold no payload any more.
        live = sum(1 for slot in self.slots.values() if slot.segment.mm[slot.offset] != RELEASED)
        near = bool(size) and places.in_use > 0.9 * max(size, self.ceiling - self._start)
        return size, places.in_use, len(self.segments), live, near

    def _first_name(self) -> str:
        """A name for the first segment; a name already taken (squatted) gets a fresh token, which
        the segments the pool grows by then share."""
        name = segment_name(self._identity, self._token)
        self._token = new_token()  # for the next try, if this name is taken
        return name

    def _numbered(self, kind: str) -> Callable[[], str]:
        """Names for a grown (`_p`) or one-off (`_x`) segment: the first's name and a random number
        (the key index names a segment by that number; a sequence would be predictable)."""
        first = self.first.name
        return lambda: f"{first}_{kind}{new_number()}"

    def _add_locked(self, segment: Segment) -> Segment:
        self.segments[segment.base] = segment
        self.own[segment.name] = segment
        return segment

    def _grow_locked(self, base: int, size: int) -> bool:
        """A new pre-faulted segment of `size` bytes at `base` (SlotPool.allocate_growing); False when
        /dev/shm has no room for it (the one-off path then says so)."""
        try:
            name, mm = create_unique_segment(self._numbered("p"), size, populate=self.cfg.prefault)
        except (OSError, ConnectorFull):
            return False
        self._counters.add("pool_grown")
        self._add_locked(Segment(name, mm, base, int(name.rsplit("_p", 1)[1])))
        return True

    def _create(self, names: Callable[[], str], size: int, populate: bool, what: str) -> tuple[str, Any]:
        """A new segment of `size` bytes under a fresh name from `names`; its failure counted and said
        (`what`: what the memory was for)."""
        try:
            return create_unique_segment(names, size, populate=populate)
        except ConnectorError:
            self._counters.add("errors")
            raise
        except OSError as exc:
            self._counters.add("errors")
            # ConnectorFull when /dev/shm (or memory) is full: the same put may work once room is made.
            full = exc.errno in (errno.ENOSPC, errno.ENOMEM)
            raise (ConnectorFull if full else ConnectorError)(
                f"SharedMemoryConnector: no shared memory for {what}: {exc}; free /dev/shm, raise the "
                "container's shm_size or lower memory_pool_size"
            ) from exc

    def _oneoff_locked(self, need: int) -> Segment:
        """A segment for one slot past the ceiling. Its errors name no put: the put's caller does."""
        name, mm = self._create(self._numbered("x"), need, False, f"{need} bytes")
        self._counters.add("fallbacks")
        segment = Segment(name, mm, None, int(name.rsplit("_x", 1)[1]))
        self.own[name] = segment
        return segment

    def _make_room_locked(self, size: int) -> int | None:
        """Growth was refused (the ceiling, or a full /dev/shm): before a one-off, take back the room the
        pool holds for nothing. Slots a consumer released since the reclaim above, then grown segments
        that hold nothing but wait out their idle time (a pool that grew for 256 MiB payloads had no
        room for a 1 GiB one for 30 s, so whether a put fell back depended on timing)."""
        self.reclaim_locked(check_takers=True)
        offset = self._places.allocate(size, header=SLOT_HEADER)
        if offset is None and self.release_idle_locked(idle_s=0.0):
            offset = self._places.allocate_growing(size, self._grow_locked, header=SLOT_HEADER)
        return offset

    def release_idle_locked(self, idle_s: float | None = None) -> int:
        """Unlink grown segments that held nothing for `idle_s` (default pool_idle_release_s; never the
        first); returns how many."""
        if self._places is None:
            return 0
        bases = self._places.release_idle(self.cfg.pool_idle_release_s if idle_s is None else idle_s)
        for base in bases:
            segment = self.segments.pop(base)
            del self.own[segment.name]
            self._on_released(segment)  # index entries into it go first
            unlink_segment(segment.name)
            with contextlib.suppress(BufferError):  # views of this process keep it mapped until GC
                segment.mm.close()
            self._counters.add("pool_released")
        return len(bases)

    # ---- slots

    def allocate(self, size: int, put_key: str, where: str, *, pool_only: bool = False) -> Slot | None:
        """A slot for a `size`-byte frame, counted as being written until `done_writing`; with
        `pool_only`, None where the pool's segments have no room (no growth, no one-off)."""
        # Large frames start on a page boundary, the slot header just before it: the codec's placing
        # of large leaves at fast page offsets relies on it.
        need = SLOT_HEADER + size
        with self.lock:
            if self.closed:
                raise ConnectorClosed(f"SharedMemoryConnector is closed ({where})")
            self.first_locked()
            places = self._places
            # Always, not only when the pool is the target: released one-off segments are unlinked here.
            if self.slots:
                reused = self.reclaim_locked(check_takers=False, reuse=(need, frame_alignment(size)))
                if reused is not None:
                    return self._refill_locked(reused, put_key)
            at = places.allocate(size, header=SLOT_HEADER)
            if at is None and self.slots:
                self.reclaim_locked(check_takers=True)
                at = places.allocate(size, header=SLOT_HEADER)
            if at is None and pool_only:
                return None
            if at is None:
                at = places.allocate_growing(size, self._grow_locked, header=SLOT_HEADER)
            if at is None:
                at = self._make_room_locked(size)
            if at is None:
                # Past the ceiling: a one-off segment, the slot header just before its first page boundary.
                offset = PAGE - SLOT_HEADER if frame_alignment(size) == PAGE else 0
                segment, capacity = self._oneoff_locked(need + offset), need
            else:
                base, offset, capacity = places.locate(at)
                segment = self.segments[base]
            self.release_idle_locked()
            # Reused pool space holds bytes of older frames: until this put writes its header, the
            # state byte must not read as RELEASED or TAKEN, or a reclaim would free the slot mid-write.
            segment.mm[offset] = FREE
            slot = Slot(segment, offset, next(self._generations), put_key, capacity)
            self.slots[(segment.name, offset)] = slot
            self.writing.add(slot)
            return slot

    def next_generation(self) -> int:
        return next(self._generations)

    def _refill_locked(self, slot: Slot, put_key: str) -> Slot:
        """A released pool slot that fits the next put, handed to it as it stands.

        Steady streams put payloads of one size: this skips a free and an allocation, and the frame
        lands in memory the last one warmed. The old generation is invalidated first, as in a free.
        """
        mm, offset = slot.segment.mm, slot.offset
        if slot.exports:
            self._drop_exports_locked(slot)
        GENERATION.pack_into(mm, offset + 16, 0)
        mm[offset] = FREE
        slot.generation = next(self._generations)
        slot.put_key = put_key
        self.writing.add(slot)
        return slot

    def done_writing(self, slot: Slot) -> None:
        self.writing.discard(slot)  # atomic; close() sets `closed` before it waits, under the lock
        if self.closed:
            with self.lock:
                if not self.writing:
                    self._idle.notify_all()

    def reclaim_locked(self, *, check_takers: bool, reuse: tuple[int, int] | None = None) -> Slot | None:
        """Free slots their consumers released; with check_takers, also those held by dead consumers.

        With `reuse` (bytes needed, alignment), the first released pool slot that fits them without
        wasting more than REUSE_SLACK is kept, not freed, and returned for the caller to refill.
        """
        self._before_reclaim()
        need, align = reuse or (0, 0)
        kept = None
        for slot in list(self.slots.values()):
            if slot.pinned:
                continue  # freed once its producer-side tensor dies (shm_outputs)
            state = slot.segment.mm[slot.offset]
            if state == RELEASED or (
                check_takers and state == TAKEN and taker_died(slot.segment.mm, slot.offset)
            ):
                if (
                    reuse is not None
                    and kept is None
                    and need <= slot.capacity <= need + REUSE_SLACK
                    and (slot.offset + SLOT_HEADER) % align == 0
                    and slot.segment.base is not None
                ):
                    kept = slot
                else:
                    self.free_locked(slot)
        return kept

    def free_locked(self, slot: Slot) -> None:
        segment = slot.segment
        if slot.exports:
            self._drop_exports_locked(slot)
        del self.slots[(segment.name, slot.offset)]
        if segment.base is None:
            del self.own[segment.name]
            unlink_segment(segment.name)
            with contextlib.suppress(BufferError):  # views of this process keep it mapped until GC
                segment.mm.close()
            return
        # Invalidate the generation first, so a racing consumer's release or take no longer matches.
        GENERATION.pack_into(segment.mm, slot.offset + 16, 0)
        segment.mm[slot.offset] = FREE
        self._places.free(segment.base + slot.offset)

    @staticmethod
    def _drop_exports_locked(slot: Slot) -> None:
        """Let go of a slot's exported CUDA tensors. A consumer that released the slot mapped them and
        gives their references back itself; any other state means no live consumer will."""
        if slot.segment.mm[slot.offset] != RELEASED:
            for exported in slot.exports:
                with contextlib.suppress(Exception):  # a CUDA error must not stop the reclaim
                    exported.release_unmapped()
        slot.exports = None

    def clean_locked(self, key: str) -> None:
        """Free what was put under `key` (or `key/...`) that no consumer holds."""
        for slot in list(self.slots.values()):
            owned = cleaned_by(slot.put_key, key)
            if owned and slot not in self.writing and slot.segment.mm[slot.offset] != TAKEN:
                if slot.pinned:  # no consumer may take it any more; freed when its empty() tensor dies
                    GENERATION.pack_into(slot.segment.mm, slot.offset + 16, 0)
                    slot.segment.mm[slot.offset] = FREE
                else:
                    self.free_locked(slot)

    # ---- lifecycle

    def close(self) -> bool:
        """Unlink and unmap every segment of this process (a forked child only unmaps its copies);
        False when a put stuck mid-copy keeps the mappings (left to process exit rather than crash).
        Mappings with live views stay alive until those views die."""
        with self.lock:
            if self.closed:
                return True
            self.closed = True
            # Puts write through raw addresses: unmapping under one of them would crash the process.
            if not self._idle.wait_for(lambda: not self.writing, timeout=CLOSE_WAIT_S):
                return False
            owner = os.getpid() == self._identity.pid
            for slot in self.slots.values():
                if slot.exports and owner and not slot.segment.mm.closed:
                    self._drop_exports_locked(slot)
            for segment in self.own.values():
                if owner:
                    unlink_segment(segment.name)
                with contextlib.suppress(BufferError):
                    segment.mm.close()
            self.own.clear()
            self.slots.clear()
            self.segments.clear()
            self._places = None
            return True
