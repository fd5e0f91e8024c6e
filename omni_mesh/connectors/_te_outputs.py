"""The Mooncake TE connector's `empty()` outputs: tensors in the registered pool, sent from there.

An output is a tensor over a pool region with HEADROOM bytes before it. A put of a payload holding
outputs sends them where they lie (the engine reads registered memory). A put of a dict of outputs
alone, the usual stage output, goes further: its frame layout is cached by the dict's keys, dtypes
and shapes, and the frame's head is written into the headroom of one of its outputs, so the put
reserves nothing, plans nothing and copies only the head (a few hundred bytes). A put of anything
else takes the general path (`_te_payloads`, `_frame_pieces.scatter`).

A region goes back to the pool when its tensor, every view of it and every payload sending from it
are gone (the pool's view finalizer). A headroom holds one head at a time: the second put of the
same output while the first is held (fan-out) takes the general path.
"""

from __future__ import annotations

import ctypes
import weakref
from typing import Any

import torch

from omni_mesh import codec
from omni_mesh.connectors import _pool_outputs
from omni_mesh.connectors._mooncake_common import RegisteredPool

#: Bytes before each output's tensor, for a frame head (heads of dicts of a few tensors are far smaller).
HEADROOM = 4096
_CACHE_SIZE = 256


class Output:
    """One live output: where its headroom lies, what empty() made, whether a held payload's head is
    in the headroom."""

    __slots__ = ("head", "dtype", "shape", "free")

    def __init__(self, head: int, tensor: torch.Tensor) -> None:
        self.head = head
        self.dtype, self.shape = tensor.dtype, tensor.shape
        # [True] while the headroom is free. Taken with pop() and given back with append(): each is
        # atomic, so two puts of one output never both take it, with no lock on the put's path.
        self.free = [True]

    def take(self) -> bool:
        try:
            return self.free.pop()
        except IndexError:  # the head of a payload still held lies there
            return False

    def give_back(self) -> None:
        self.free.append(True)


class Planned:
    """A dict of outputs laid out for the engine: the head in an output's headroom, every tensor a piece."""

    __slots__ = ("nbytes", "pieces", "sources", "headroom")

    def __init__(
        self, nbytes: int, pieces: list[tuple[int, int, int]], sources: list[Any], headroom: Output
    ) -> None:
        self.nbytes = nbytes
        self.pieces = pieces  # (source address, offset in the frame, bytes), in frame order
        self.sources = sources  # the tensors: kept alive (and unchanged) while the payload is held
        self.headroom = headroom  # whose headroom holds the head: free again when the payload goes


class Outputs:
    """The live outputs of one connector's pool; thread-safe (single dict and list operations)."""

    def __init__(self, pool: RegisteredPool) -> None:
        self._pool = pool
        self.live: dict[int, Output] = {}  # tensor address -> its output (empty: no put looks further)
        self._layouts: dict[tuple, tuple[bytes, list[tuple[int, int, int]], int]] = {}

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
        """A tensor over a fresh region (with its headroom), or None when the pool has no room now."""
        nbytes = _pool_outputs.nbytes_of(shape, dtype)
        offset = self._pool.allocate(HEADROOM + nbytes, 0.0)
        if offset is None:
            return None
        region = self._pool.view(offset, HEADROOM + nbytes)  # freed when it and every view are gone
        tensor, base = _pool_outputs.tensor_over(region, HEADROOM, shape, dtype)
        address = tensor.data_ptr()
        self.live[address] = Output(region.ctypes.data, tensor)  # one dict store: atomic
        # Runs at the same collection that frees the region: the address is never reused before.
        weakref.finalize(base, self.live.pop, address, None)
        return tensor

    def plan(self, data: dict) -> Planned | None:
        """The layout of a dict whose values are all whole outputs, its head written into a free
        headroom; None for anything else (the general path sends outputs from the pool all the same)."""
        signature: list[Any] = []
        addresses = []
        outputs = []
        live = self.live
        page_mask = codec.PAGE - 1
        for key, value in data.items():
            if type(value) is not torch.Tensor:
                return None
            address = value.data_ptr()
            output = live.get(address)
            if output is None:
                return None
            dtype, shape = value.dtype, value.shape
            # The dtype, shape and contiguity empty() made: exactly the region's bytes.
            if dtype is not output.dtype or shape != output.shape or not value.is_contiguous():
                return None
            signature += (key, dtype, shape, address & page_mask)  # page offsets place the leaves
            addresses.append(address)
            outputs.append(output)
        if not outputs:
            return None
        layout = self._layouts.get(key := tuple(signature))
        if layout is None:
            layout = self._layouts[key] = self._layout(data)
            if len(self._layouts) > _CACHE_SIZE:
                self._layouts.clear()
        head, leaves, nbytes = layout
        if len(head) > HEADROOM:
            return None
        for headroom in outputs:
            if headroom.take():
                break
        else:  # every headroom holds the head of a payload still held
            return None
        ctypes.memmove(headroom.head, head, len(head))
        pieces = [(headroom.head, 0, len(head))]
        pieces += [(addresses[i], offset, length) for i, offset, length in leaves]
        return Planned(nbytes, pieces, list(data.values()), headroom)

    @staticmethod
    def _layout(data: dict) -> tuple[bytes, list[tuple[int, int, int]], int]:
        """(frame head, (value index, frame offset, bytes) of each tensor in frame order, frame size)."""
        frame = codec.plan(data)
        index = {id(value): i for i, value in enumerate(data.values())}
        placed = zip(frame.leaves, frame.offsets, frame.lengths, strict=True)
        leaves = [(index[id(leaf)], offset, length) for leaf, offset, length in placed if id(leaf) in index]
        return frame.head, leaves, frame.nbytes
