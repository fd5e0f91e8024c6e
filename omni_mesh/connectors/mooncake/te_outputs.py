"""The Mooncake TE connector's `empty()` outputs: tensors in the registered pool, sent from there.

An output is a tensor over a pool region with HEADROOM bytes before it. A put of a payload holding
outputs sends them where they lie (the engine reads registered memory). A put of a dict of outputs
alone, the usual stage output, goes further: its frame layout is cached by the dict's keys, dtypes
and shapes, and the frame's head is written into the headroom of one of its outputs, so the put
reserves nothing, plans nothing and copies only the head (a few hundred bytes). A put of anything
else takes the general path (`mooncake.te_payloads`, `mooncake.frame_pieces.scatter`).

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
from omni_mesh.connectors.pools import outputs as _pool_outputs
from omni_mesh.connectors.pools.registered import RegisteredPool

#: Bytes before each output's tensor, for a frame head (heads of dicts of a few tensors are far smaller).
HEADROOM = 4096
_CACHE_SIZE = 256


class Output:
    """One live output: where its headroom lies, what empty() made, whether a held payload's head is
    in the headroom."""

    __slots__ = ("head", "dtype", "shape", "kind", "free", "written", "pieces")

    def __init__(self, head: int, tensor: torch.Tensor, kind: int) -> None:
        self.head = head
        self.dtype, self.shape = tensor.dtype, tensor.shape
        self.kind = kind  # the same for every output of this dtype, shape and page offset
        self.written: bytes | None = None  # the frame head its headroom holds (only puts write there)
        self.pieces: tuple[Any, list] | None = None  # (layout, its pieces) of a put of this output alone
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


#: A dict of outputs laid out for the engine: (frame size, pieces (source address, offset in the frame,
#: bytes) in frame order, the tensors to keep alive and unchanged while the payload is held, the
#: output whose headroom holds the head: free again when the payload goes).
Planned = tuple[int, list[tuple[int, int, int]], list[Any], Output]


class Outputs:
    """The live outputs of one connector's pool; thread-safe (single dict and list operations)."""

    def __init__(self, pool: RegisteredPool) -> None:
        self._pool = pool
        # tensor address -> (its output, dtype, shape, kind) (empty: no put looks further)
        self.live: dict[int, _pool_outputs.Entry] = {}
        self._kinds = _pool_outputs.Kinds(_CACHE_SIZE)  # of (dtype, shape, page offset): it places the leaf
        self._layouts: dict[tuple, tuple[bytes, list[tuple[int, int, int]], int]] = {}
        # A new output is laid out at empty() for the put its kind last had alone, its head written
        # into its headroom outside the put; a put writes its head only when the headroom holds another.
        # Laid-out puts: (the Planned put, the head its output's headroom was given).
        self._ready = _pool_outputs.ReadyPuts(_CACHE_SIZE)

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
        """A tensor over a fresh region (with its headroom), or None when the pool has no room now."""
        nbytes = _pool_outputs.nbytes_of(shape, dtype)
        offset = self._pool.allocate(HEADROOM + nbytes, 0.0)
        if offset is None:
            return None
        region = self._pool.view(offset, HEADROOM + nbytes)  # freed when it and every view are gone
        tensor, base = _pool_outputs.tensor_over(region, HEADROOM, shape, dtype)
        address = tensor.data_ptr()
        kind, cleared = self._kinds.of((tensor.dtype, tensor.shape, address & (codec.PAGE - 1)))
        if cleared:
            self._ready.forget_kinds()
        output = Output(region.ctypes.data, tensor, kind)
        last = self._ready.last(kind)
        if last is not None:
            self._lay_out(tensor, base, output, *last)
        self.live[address] = (output, output.dtype, output.shape, kind)  # one dict store: atomic
        # Runs at the same collection that frees the region: the address is never reused before.
        weakref.finalize(base, self.live.pop, address, None)
        return tensor

    def _lay_out(self, tensor: torch.Tensor, base: Any, output: Output, name: str, layout: tuple) -> None:
        """Lay `tensor` out for a put of {name: tensor} (`take_ready`), its head in the headroom; the
        payload keeps `base` (the tensor's array) alive, and with it the region. (`plan` remembers
        only layouts within the pool's ceiling.)"""
        head, leaves, nbytes = layout
        ctypes.memmove(output.head, head, len(head))
        output.written = head
        pieces = self._pieces(output, head, leaves, [tensor.data_ptr()])
        output.pieces = (layout, pieces)
        self._ready.add(tensor, name, ((nbytes, pieces, [base], output), head))

    def take_ready(self, data: dict) -> Planned | None:
        """The put of {name: output} as empty() laid it out; None for anything else, or while the
        headroom holds another payload's head (`plan` then looks further)."""
        laid_out = self._ready.match(data)
        if laid_out is None:
            return None
        planned, head = laid_out
        output = planned[3]
        if output.written is not head or not output.take():
            return None
        return planned

    def plan(self, data: dict) -> Planned | None:
        """The layout of a dict whose values are all whole outputs, its head written into a free
        headroom; None for anything else (the general path sends outputs from the pool all the same)."""
        matched = _pool_outputs.match_whole(data, self.live)
        if matched is None:
            return None
        signature, addresses, entries = matched
        outputs = [entry[0] for entry in entries]
        layout = self._layouts.get(signature)
        if layout is None:
            layout = self._layouts[signature] = self._layout(data)
            if len(self._layouts) > _CACHE_SIZE:  # kinds stay: live outputs hold theirs
                self._layouts.clear()
        head, leaves, nbytes = layout
        if len(head) > HEADROOM or nbytes > self._pool.ceiling:  # the general path says why it fails
            return None
        for headroom in outputs:
            if headroom.take():
                break
        else:  # every headroom holds the head of a payload still held
            return None
        if headroom.written is not head:
            ctypes.memmove(headroom.head, head, len(head))
            headroom.written = head
        if len(outputs) == 1:  # one output alone, the usual case: its pieces are the same every time
            self._ready.remember(headroom.kind, next(iter(data)), layout)
            cached = headroom.pieces
            if cached is None or cached[0] is not layout:
                cached = headroom.pieces = (layout, self._pieces(headroom, head, leaves, addresses))
            return nbytes, cached[1], list(data.values()), headroom
        return nbytes, self._pieces(headroom, head, leaves, addresses), list(data.values()), headroom

    @staticmethod
    def _pieces(
        headroom: Output, head: bytes, leaves: list[tuple[int, int, int]], addresses: list[int]
    ) -> list:
        pieces = [(headroom.head, 0, len(head))]
        pieces += [(addresses[i], offset, length) for i, offset, length in leaves]
        return pieces

    @staticmethod
    def _layout(data: dict) -> tuple[bytes, list[tuple[int, int, int]], int]:
        """(frame head, (value index, frame offset, bytes) of each tensor in frame order, frame size)."""
        frame = codec.plan(data)
        index = {id(value): i for i, value in enumerate(data.values())}
        placed = zip(frame.leaves, frame.offsets, frame.lengths, strict=True)
        leaves = [(index[id(leaf)], offset, length) for leaf, offset, length in placed if id(leaf) in index]
        return frame.head, leaves, frame.nbytes
