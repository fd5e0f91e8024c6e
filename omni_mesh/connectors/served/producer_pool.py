"""ZmqConnector's producer memory: the pool payloads are served from, and `empty()` outputs.

A put writes the payload's frame into a slot of a reused (already faulted-in) anonymous mapping that
grows by pre-faulted regions up to a ceiling; past it a payload takes a one-off buffer. `empty()` hands
out a tensor over a pool slot: a put whose payload holds such tensors sends them from where they lie
(the parts form: header, then each leaf), copying nothing of them; their slot goes back once sent (or
dropped) and the producer's tensor is gone. A mixin of `ServedConnector` (its slots, held table, lock).
"""

from __future__ import annotations

import collections
import contextlib
import functools
import mmap
import threading
import weakref
from typing import TYPE_CHECKING, Any

from omni_mesh.codec import FramePlan, plan
from omni_mesh.connectors.keys import edge_key
from omni_mesh.connectors.pools import growth as _growth
from omni_mesh.connectors.pools import outputs
from omni_mesh.connectors.pools.held import Held
from omni_mesh.lazy_torch import import_torch

if TYPE_CHECKING:
    import torch


class _Region:
    """A pool slot empty() handed out: freed once it is no longer sent from and its tensor is gone."""

    __slots__ = ("offset", "view", "address", "dtype", "shape", "kind", "state", "dead")

    def __init__(self, offset: int, view: memoryview, tensor: torch.Tensor) -> None:
        self.offset = offset
        self.view = view  # its bytes, as a put sends them
        self.address = tensor.data_ptr()  # the key of ZmqConnector._unsent
        self.dtype, self.shape = tensor.dtype, tensor.shape  # as empty() made it
        self.kind = -1  # names dtype and shape in the connector's layout cache (outputs.Kinds)
        self.state = "unsent"  # -> "held" (put) -> "done" (sent, expired or cleaned up)
        self.dead = False  # the producer's tensor (and every view of it) was garbage-collected


def _queue_dead(queue: collections.deque, region: _Region, ref: weakref.ref) -> None:
    queue.append((id(ref), region))  # GC may run this anywhere: no lock here


def anonymous_map(size: int, *, populate: bool = False) -> mmap.mmap:
    """Page-aligned memory (so 64-byte aligned slots); huge pages make its first touch ~5x cheaper."""
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | (mmap.MAP_POPULATE if populate else 0)
    region = mmap.mmap(-1, size, flags=flags)
    with contextlib.suppress(AttributeError, OSError):  # no THP support: plain pages
        region.madvise(mmap.MADV_HUGEPAGE)
    return region


class PoolProducer:
    """The producer side of ZmqConnector: its pool, puts and `empty()` (module docstring)."""

    def _init_pool(self, cfg: Any) -> None:
        self._pool: mmap.mmap | None = None  # created with the server, on the first put
        self._maps: dict[int, mmap.mmap] = {}  # every region of the pool by its base (the first: 0)
        self._ceiling = _growth.ceiling(cfg.memory_pool_size, cfg.max_pool_size, _growth.ram())
        self._in_flight = 0
        # empty() slots: those not put yet by tensor address, weak references to their tensors' arrays
        # (so the callbacks run) and the regions whose tensors died (queued by those callbacks).
        self._regions_lock = threading.Lock()
        self._unsent: dict[int, outputs.Entry] = {}  # tensor address -> (its region, dtype, shape, kind)
        self._pins: dict[int, weakref.ref] = {}
        self._dead: collections.deque[tuple[int, _Region]] = collections.deque()
        # empty() slots laid out for the put their kind last had alone: (size, parts, [its region])
        self._ready = outputs.ReadyPuts()

    def _open_pool(self) -> None:
        """The pool's first region, mapped when the server starts."""
        if self._slots.size:
            self._pool = self._maps[0] = anonymous_map(self._slots.size)

    def _region(self, offset: int, length: int) -> memoryview:
        """The pool's bytes [offset, offset + length), in whichever region holds them."""
        base, local = self._slots.region_of(offset)
        return memoryview(self._maps[base])[local : local + length]

    def _release_idle(self) -> None:
        for base in self._slots.release_idle(self.config.pool_idle_release_s):
            del self._maps[base]  # frames still being sent from it keep it mapped until they are done
            self._counters.add("pool_released")

    def _allocate(self, nbytes: int) -> int | None:
        """A pool offset for `nbytes`, growing the pool by a pre-faulted region if none is free and the
        ceiling allows; None past it."""
        self._server.reap()  # slots whose frames went out since the last poll: reuse them, still warm
        self._drain_dead()
        self._release_idle()
        offset = self._slots.allocate(nbytes)
        if offset is not None or not self._slots.size:
            return offset
        size = _growth.grown_size(nbytes + mmap.PAGESIZE)
        with self._lock:  # one growth at a time: concurrent puts must not each add a region
            offset = self._slots.allocate(nbytes)
            if offset is not None or self._slots.size + size > self._ceiling:
                return offset
            try:
                region = anonymous_map(size, populate=True)
            except OSError:
                return None  # no memory for it: the one-off path says so
            self._maps[self._slots.add_region(size)] = region
            self._counters.add("pool_grown")
        return self._slots.allocate(nbytes)

    def _put(self, from_stage: str, to_stage: str, put_key: str, data: Any) -> tuple[int, dict | None]:
        if self._server is None or self._closed:
            self._start_server()
        if self._unsent and type(data) is dict:
            sent = self._put_outputs(edge_key(from_stage, to_stage, put_key), put_key, data)
            if sent is not None:
                return sent
        frame = plan(data)
        key = edge_key(from_stage, to_stage, put_key)
        if self._unsent:
            with self._regions_lock:
                resident = outputs.take_resident(frame, self._unsent)
                for region in resident.values():
                    region.state = "held"
            if resident:
                return self._put_parts(key, put_key, frame, resident)
        offset = self._allocate(frame.nbytes)
        buffer = None
        try:
            if offset is None:  # past the pool's ceiling: a one-off buffer, freed like a slot
                buffer = anonymous_map(frame.nbytes)
                frame.write_into(buffer)
                self._counters.add("oneoff")
            else:
                frame.write_into(self._region(offset, frame.nbytes))
        except BaseException:
            if offset is not None:
                self._slots.free(offset)
            raise
        held = self._hold(key, put_key, frame.nbytes, offset, buffer)
        return frame.nbytes, {"endpoint": self.endpoint, "key": key, "token": held.token, "size": frame.nbytes}

    def empty(self, shape: tuple[int, ...] | list[int], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialized tensor in a pool slot: returned in a put's payload, it is sent from there
        (module docstring). Do not write into it after the put."""
        shape = tuple(int(n) for n in shape)
        nbytes = outputs.nbytes_of(shape, dtype)
        if nbytes < outputs.MIN_BYTES:
            return import_torch().empty(shape, dtype=dtype)
        self._start_server()  # the pool comes with it
        offset = self._allocate(nbytes)
        if offset is None:  # past the ceiling: an ordinary tensor, copied at put as any other
            return import_torch().empty(shape, dtype=dtype)
        view = self._region(offset, nbytes)
        tensor, base = outputs.tensor_over(view, 0, shape, dtype)
        region = _Region(offset, view, tensor)
        with self._regions_lock:
            region.kind = outputs.KINDS.of((region.dtype, region.shape))[0]
            self._unsent[region.address] = (region, region.dtype, region.shape, region.kind)
            ref = weakref.ref(base, functools.partial(_queue_dead, self._dead, region))
            self._pins[id(ref)] = ref
        last = self._ready.last(region.kind)
        if last is not None:  # the put of {name: tensor}, laid out now, outside the put
            name, (header, layout, size) = last
            parts = [header, *(b"" if slot < 0 else view for slot in layout)]
            self._ready.add(tensor, name, (size, parts, [region]))
        return tensor

    def _put_parts(self, key: str, put_key: str, frame: FramePlan, resident: dict[int, _Region]) -> tuple[int, dict]:
        """The parts form: the header, then each leaf; empty() tensors sent from where they lie (the
        put touches none of their bytes), padding as empty frames, other leaves copied."""
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
            held = self._hold(key, put_key, size, None, parts, regions=list(resident.values()))
        except BaseException:
            with self._regions_lock:  # not put after all: the tensors may still be
                for region in resident.values():
                    region.state = "unsent"
                    self._unsent[region.address] = (region, region.dtype, region.shape, region.kind)
            raise
        return size, {"endpoint": self.endpoint, "key": key, "token": held.token, "size": size}

    def _put_outputs(self, key: str, put_key: str, data: dict) -> tuple[int, dict] | None:
        """A dict of empty() tensors alone: the parts form from a cached header, nothing planned or
        copied (see outputs.take_outputs), or for one tensor alone as empty() laid it out
        (ReadyPuts); None for any other payload."""
        laid_out = self._ready.match(data)
        taken = None
        with self._regions_lock:
            if laid_out is not None and self._unsent.pop(laid_out[2][0].address, None) is not None:
                size, parts, regions = laid_out  # its one region was still unsent: this put takes it
            else:
                taken = outputs.take_outputs(data, self._unsent)
                if taken is None:
                    return None
                header, layout, regions, size = taken
            for region in regions:
                region.state = "held"
        if taken is not None:
            parts = [header, *(b"" if slot < 0 else regions[slot].view for slot in layout)]  # b"": padding
            if len(regions) == 1:  # one tensor alone: the next empty() of its kind is laid out for this put
                self._ready.remember(regions[0].kind, next(iter(data)), (header, layout, size))
        token = self._hold_later(key, put_key, size, parts, regions)
        return size, {"endpoint": self.endpoint, "key": key, "token": token, "size": size}

    def _drain_dead(self) -> None:
        """Regions whose tensor died: free those not sent from (any more)."""
        while self._dead:
            ref_id, region = self._dead.popleft()
            with self._regions_lock:
                self._pins.pop(ref_id, None)
                region.dead = True
                if region.state == "unsent":
                    del self._unsent[region.address]
                free = region.state != "held"
            if free:
                self._slots.free(region.offset)

    def _release(self, held: Held) -> None:
        super()._release(held)
        for region in held.regions:
            with self._regions_lock:
                region.state = "done"
                free = region.dead
            if free:
                self._slots.free(region.offset)
        held.regions = []

    def _pool_health(self) -> dict:
        self._release_idle()
        return {
            "in_flight": self._in_flight,
            "pool_regions": self._slots.regions,
            "max_pool_size": self._ceiling,
        }

    def _close_pool(self) -> None:
        self._pool = None  # unmapped once every frame sent from it is released
        self._maps.clear()
