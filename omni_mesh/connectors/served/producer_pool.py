"""ZmqConnector's producer memory: the pool payloads are served from, and `empty()` outputs.

A put writes the payload's frame into a slot of a reused (already faulted-in) anonymous mapping that
grows by pre-faulted regions up to a ceiling (`pools.slots.SlotPool` keeps the slots, this object the
mappings); past it a payload takes a one-off buffer. `empty()` hands out a tensor over a pool slot: a
put whose payload holds such tensors sends them from where they lie (the parts form: header, then
each leaf), copying nothing of them; their slot goes back once sent (or dropped) and the producer's
tensor is gone. Memory only: what is held for whom is the connector's (`HeldTable`).
"""

from __future__ import annotations

import collections
import functools
import mmap
import threading
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from omni_mesh.codec import FramePlan
from omni_mesh.connectors.counters import Counters
from omni_mesh.connectors.pools import outputs
from omni_mesh.connectors.pools.growth import anonymous_map
from omni_mesh.connectors.pools.held import Held
from omni_mesh.connectors.pools.slots import SlotPool
from omni_mesh.lazy_torch import import_torch

if TYPE_CHECKING:
    import torch


class _Region:
    """A pool slot empty() handed out: freed once it is no longer sent from and its tensor is gone."""

    __slots__ = ("offset", "view", "address", "dtype", "shape", "kind", "state", "dead")

    def __init__(self, offset: int, view: memoryview, tensor: torch.Tensor) -> None:
        self.offset = offset
        self.view = view  # its bytes, as a put sends them
        self.address = tensor.data_ptr()  # the key of ProducerPool.unsent
        self.dtype, self.shape = tensor.dtype, tensor.shape  # as empty() made it
        self.kind = -1  # names dtype and shape in the connector's layout cache (outputs.Kinds)
        self.state = "unsent"  # -> "held" (put) -> "done" (sent, expired or cleaned up)
        self.dead = False  # the producer's tensor (and every view of it) was garbage-collected


def _queue_dead(queue: collections.deque, region: _Region, ref: weakref.ref) -> None:
    queue.append((id(ref), region))  # GC may run this anywhere: no lock here


#: A payload laid out in the parts form: (its size, its parts, the empty() regions it is sent from).
Parts = tuple[int, list[Any], list[_Region]]


class ProducerPool:
    """The memory a ZmqConnector producer serves payloads from (module docstring). Thread-safe.

    `slots` keeps the offsets (one space across the mappings); `before_allocate` runs before each
    allocation (the server's reap: slots whose frames went out come back while still warm);
    `counters` gets "oneoff", "pool_grown" and "pool_released".
    """

    def __init__(
        self, slots: SlotPool, idle_release_s: float, counters: Counters, before_allocate: Callable[[], None]
    ) -> None:
        self.slots = slots
        self._maps: dict[int, mmap.mmap] = {}  # every mapping of the pool by its base (the first: 0)
        self._idle_release_s = idle_release_s
        self._counters = counters
        self._before_allocate = before_allocate
        # empty() slots: those not put yet by tensor address (`unsent`), weak references to their
        # tensors' arrays (so the callbacks run) and the regions whose tensors died (queued by those).
        self._lock = threading.Lock()
        self.unsent: dict[int, outputs.Entry] = {}  # tensor address -> (its region, dtype, shape, kind)
        self._pins: dict[int, weakref.ref] = {}
        self._dead: collections.deque[tuple[int, _Region]] = collections.deque()
        # empty() slots laid out for the put their kind last had alone: (size, parts, [its region])
        self.ready = outputs.ReadyPuts()

    def open(self) -> None:
        """Map the pool's first region (when the server starts)."""
        if self.slots.size:
            self._maps[0] = anonymous_map(self.slots.size)

    def region(self, offset: int, length: int) -> memoryview:
        """The pool's bytes [offset, offset + length), in whichever mapping holds them."""
        base, local = self.slots.region_of(offset)
        return memoryview(self._maps[base])[local : local + length]

    def release_idle(self) -> None:
        for base in self.slots.release_idle(self._idle_release_s):
            del self._maps[base]  # frames still being sent from it keep it mapped until they are done
            self._counters.add("pool_released")

    def allocate(self, nbytes: int) -> int | None:
        """A pool offset for `nbytes`, the pool grown by a pre-faulted mapping where none is free and
        the ceiling allows; None past it."""
        self._before_allocate()
        self._drain_dead()
        self.release_idle()
        return self.slots.allocate_growing(nbytes, self._map_region)

    def _map_region(self, base: int, size: int) -> bool:
        try:
            self._maps[base] = anonymous_map(size, populate=True)
        except OSError:
            return False  # no memory for it: the one-off path says so
        self._counters.add("pool_grown")
        return True

    def write(self, frame: FramePlan) -> tuple[int | None, Any]:
        """Lay `frame` into a slot: (its offset, None), or past the ceiling (None, a one-off buffer)."""
        offset = self.allocate(frame.nbytes)
        if offset is None:  # past the pool's ceiling: a one-off buffer, freed like a slot
            buffer = anonymous_map(frame.nbytes)
            frame.write_into(buffer)
            self._counters.add("oneoff")
            return None, buffer
        try:
            frame.write_into(self.region(offset, frame.nbytes))
        except BaseException:
            self.slots.free(offset)
            raise
        return offset, None

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype, nbytes: int) -> torch.Tensor:
        """An uninitialized tensor of `nbytes` in a pool slot (an ordinary one past the ceiling)."""
        offset = self.allocate(nbytes)
        if offset is None:  # copied at put as any other tensor
            return import_torch().empty(shape, dtype=dtype)
        view = self.region(offset, nbytes)
        tensor, base = outputs.tensor_over(view, 0, shape, dtype)
        region = _Region(offset, view, tensor)
        with self._lock:
            region.kind = outputs.KINDS.of((region.dtype, region.shape))[0]
            self.unsent[region.address] = (region, region.dtype, region.shape, region.kind)
            ref = weakref.ref(base, functools.partial(_queue_dead, self._dead, region))
            self._pins[id(ref)] = ref
        last = self.ready.last(region.kind)
        if last is not None:  # the put of {name: tensor}, laid out now, outside the put
            name, (header, layout, size) = last
            parts = [header, *(b"" if slot < 0 else view for slot in layout)]
            self.ready.add(tensor, name, (size, parts, [region]))
        return tensor

    def take_outputs(self, data: dict) -> Parts | None:
        """A dict of empty() tensors alone: the parts form from a cached header, nothing planned or
        copied (see outputs.take_outputs), or for one tensor alone as empty() laid it out
        (ReadyPuts); None for any other payload."""
        laid_out = self.ready.match(data)
        taken = None
        with self._lock:
            if laid_out is not None and self.unsent.pop(laid_out[2][0].address, None) is not None:
                size, parts, regions = laid_out  # its one region was still unsent: this put takes it
            else:
                taken = outputs.take_outputs(data, self.unsent)
                if taken is None:
                    return None
                header, layout, regions, size = taken
            for region in regions:
                region.state = "held"
        if taken is not None:
            parts = [header, *(b"" if slot < 0 else regions[slot].view for slot in layout)]  # b"": padding
            if len(regions) == 1:  # one tensor alone: the next empty() of its kind is laid out for this put
                self.ready.remember(regions[0].kind, next(iter(data)), (header, layout, size))
        return size, parts, regions

    def take_resident(self, frame: FramePlan) -> Parts | None:
        """The parts form of a payload holding empty() tensors: the header, then each leaf; those
        tensors sent from where they lie (nothing of them touched), padding as empty frames, other
        leaves copied. None when it holds none. `unsend` gives them back if the put fails after."""
        with self._lock:
            resident = outputs.take_resident(frame, self.unsent)
            for region in resident.values():
                region.state = "held"
        if not resident:
            return None
        parts: list[Any] = [frame.header]
        size = len(frame.header)
        lengths = frame.lengths
        try:
            for index, leaf in enumerate(frame.leaves):
                region = resident.get(index)
                if region is not None:
                    parts.append(region.view)
                    size += lengths[index]
                elif outputs.is_padding(leaf):
                    parts.append(b"")
                else:
                    part = outputs.leaf_bytes(leaf, lengths[index])  # not in the pool: copied
                    parts.append(part)
                    size += len(part)
        except BaseException:
            self.unsend(list(resident.values()))
            raise
        return size, parts, list(resident.values())

    def unsend(self, regions: list[_Region]) -> None:
        """Not put after all: the tensors may still be."""
        with self._lock:
            for region in regions:
                region.state = "unsent"
                self.unsent[region.address] = (region, region.dtype, region.shape, region.kind)

    def _drain_dead(self) -> None:
        """Regions whose tensor died: free those not sent from (any more)."""
        while self._dead:
            ref_id, region = self._dead.popleft()
            with self._lock:
                self._pins.pop(ref_id, None)
                region.dead = True
                if region.state == "unsent":
                    del self.unsent[region.address]
                free = region.state != "held"
            if free:
                self.slots.free(region.offset)

    def release(self, held: Held) -> None:
        """Free what `held` is sent from: its slot or buffer, and its empty() regions whose tensor died."""
        if held.offset is not None:
            self.slots.free(held.offset)
        held.buffer = None
        for region in held.regions:
            with self._lock:
                region.state = "done"
                free = region.dead
            if free:
                self.slots.free(region.offset)
        held.regions = []

    def health(self) -> dict[str, int]:
        self.release_idle()
        return {"pool_regions": self.slots.regions, "max_pool_size": self.slots.ceiling}

    def close(self) -> None:
        self._maps.clear()  # unmapped once every frame sent from it is released
