"""A planned frame: its layout (offsets, padding, head) and the ways to lay it into memory.

`FramePlan.write_into` / `write_at` lay the whole frame; `FramePlan.pieces()` is the scatter form for
transports that place the frame themselves (from several sources, or to several destinations): the
head and each leaf, with the offset where it belongs in the frame.
"""

from __future__ import annotations

import ctypes
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

from omni_mesh.codec.format import ALIGN, MAGIC, PAGE, PREFIX, VERSION, align
from omni_mesh.lazy_torch import import_torch, tensor_class


class PagePad:
    """An unreferenced buffer placed before a large leaf to choose the leaf's page offset.

    memcpy speed depends on where the destination sits relative to the source modulo 4096: equal
    offsets hit 4K aliasing in the vector loop (slow at mid sizes), and a destination slightly ahead
    of the source makes glibc's non-temporal path fall back (about 4x slower at 256 MiB). Measured on
    this project's machines, a destination 64 bytes behind the source is fast at every size.
    Decoders need nothing: a buffer no leaf references is legal and ignored.
    """

    __slots__ = ("page_offset",)

    def __init__(self, address: int) -> None:
        self.page_offset = (address - ALIGN) % PAGE & ~(ALIGN - 1)



class FramePlan:
    """An object tree planned into a frame: its size is known before any byte is written.

    Offsets assume the frame starts on a page boundary; destinations that cannot promise that still
    get a valid frame, only without the page-offset matching of large leaves.
    """

    __slots__ = ("header", "leaves", "lengths", "offsets", "nbytes", "head", "payload_bytes")

    def __init__(self, header: bytes, leaves: list[Any], lengths: list[int]) -> None:
        self.header = header
        self.leaves = leaves
        pads = tuple(leaf.page_offset for leaf in leaves if type(leaf) is PagePad)
        key = (header, tuple(lengths), pads)
        layout = _LAYOUTS.get(key)
        if layout is None:
            layout = _layout(header, leaves, lengths)
            if len(_LAYOUTS) >= LAYOUT_CACHE_SIZE:
                _LAYOUTS.clear()
            _LAYOUTS[key] = layout
        self.lengths, self.offsets, self.nbytes, self.head, self.payload_bytes = layout

    def write_into(self, dest: Any, offset: int = 0) -> int:
        """Lay the whole frame into `dest` (any writable buffer) at `offset`; returns its size."""
        with memoryview(dest) as whole:
            if whole.readonly or whole.nbytes < offset + self.nbytes:
                raise ValueError(
                    f"destination holds {whole.nbytes - offset} writable bytes, frame needs {self.nbytes}"
                )
            flat = whole if whole.format == "B" and whole.ndim == 1 else whole.cast("B")
            with flat[offset : offset + self.nbytes] as view:
                # The export keeps the destination in place while write_at copies to its address.
                self.write_at(ctypes.addressof(ctypes.c_char.from_buffer(view)))
            if flat is not whole:
                flat.release()
        return self.nbytes

    def inline_parts(self) -> list[bytearray]:
        """Each leaf as its own buffer (padding as empty ones): the parts form, for tiny payloads."""
        lengths = [0 if type(leaf) is PagePad else n for leaf, n in zip(self.leaves, self.lengths, strict=True)]
        return leaf_buffers(self.leaves, lengths)

    def pieces(self) -> list[Piece]:
        """The frame as a scatter list, in frame order: the head at 0, then every leaf that has bytes
        (padding left out). Writing each piece at its offset of a region lays the whole frame."""
        out = [Piece(0, len(self.head), self.head, -1)]
        placed = zip(self.leaves, self.offsets, self.lengths, strict=True)
        for index, (leaf, offset, length) in enumerate(placed):
            if length and type(leaf) is not PagePad:
                out.append(Piece(offset, length, leaf, index))
        return out

    def write_at(self, address: int) -> int:
        """Lay the frame at a raw `address` the caller guarantees holds `nbytes` mapped, writable bytes.

        The hot path of the shared-memory pool: no buffer exports, only memmoves. Strided leaves
        still go through torch/numpy, over a ctypes array at the address.
        """
        ctypes.memmove(address, self.head, len(self.head))
        self._write_leaves(address)
        return self.nbytes

    def write_into_map(self, mm: Any, start: int, address: int) -> int:
        """`write_at` for a frame at byte `start` of a mapping `mm` whose byte `start` is at `address`:
        the head goes in by slice assignment, which costs a fraction of a ctypes call (tiny payloads)."""
        mm[start : start + len(self.head)] = self.head
        self._write_leaves(address)
        return self.nbytes

    def to_bytes(self) -> bytes:
        """The whole frame as one bytes object, for a frame small enough to travel in a message: the
        head and each leaf's bytes, zeros between them. No mapping and no ctypes buffer export: for
        tiny frames those cost more than the copies."""
        out = [self.head]
        at = len(self.head)
        leaves, offsets, lengths = self.leaves, self.offsets, self.lengths
        tensor = tensor_class()
        for index in range(len(leaves)):  # not zip(): its strict= keyword alone costs more than a tiny leaf
            leaf, offset, length = leaves[index], offsets[index], lengths[index]
            if not length or type(leaf) is PagePad:
                continue
            if offset > at:
                out.append(bytes(offset - at))
            if type(leaf) is tensor and leaf.is_contiguous():
                out.append(ctypes.string_at(leaf.data_ptr(), length))  # the common case, one copy
            else:
                out.append(leaf_buffers([leaf], [length])[0])
            at = offset + length
        if self.nbytes > at:
            out.append(bytes(self.nbytes - at))
        return b"".join(out)

    def _write_leaves(self, address: int) -> None:
        # Not zip(): its strict= keyword alone costs more than copying a tiny leaf (leaves, offsets and
        # lengths are built together).
        leaves, offsets, lengths = self.leaves, self.offsets, self.lengths
        tensor = tensor_class()
        for index in range(len(leaves)):
            leaf, off, length = leaves[index], offsets[index], lengths[index]
            if not length or type(leaf) is PagePad:
                continue
            if type(leaf) is tensor and leaf.is_contiguous():
                ctypes.memmove(address + off, leaf.data_ptr(), length)  # the common case, without dispatch
            else:
                view = memoryview((ctypes.c_char * length).from_address(address + off)).cast("B")
                copy_leaf(leaf, view, address + off, 0, length)
                view.release()


LAYOUT_CACHE_SIZE = 512
_LAYOUTS: dict[tuple, tuple[list[int], list[int], int, bytes, int]] = {}


def _layout(header: bytes, leaves: list[Any], lengths: list[int]) -> tuple[list[int], list[int], int, bytes, int]:
    """(lengths with pads sized, buffer offsets, frame size, prefix + table + header, payload bytes) of a
    frame; payload bytes count the header and the leaves, not the frame's prefix, table and padding."""
    payload_bytes = len(header) + sum(lengths)  # pads are still 0 here
    lengths = list(lengths)
    offsets = []
    count = len(lengths)
    pos = PREFIX.size + 8 * count + len(header)
    for i, leaf in enumerate(leaves):
        start = align(pos)
        if type(leaf) is PagePad:
            lengths[i] = (leaf.page_offset - start) % PAGE
        offsets.append(start)
        pos = start + lengths[i]
    # Prefix, buffer table and header in one piece: written with a single copy.
    table = struct.pack(f"<{count}Q", *lengths) if count else b""
    head = PREFIX.pack(MAGIC, VERSION, 0, count, len(header), pos) + table + header
    return lengths, offsets, pos, head, payload_bytes


def copy_leaf(leaf: Any, view: memoryview, address: int, offset: int, length: int) -> None:
    # ctypes.memmove releases the GIL and runs at memcpy speed; strided sources go through torch/numpy.
    if isinstance(leaf, tensor_class()):
        if leaf.is_contiguous():
            ctypes.memmove(address + offset, leaf.data_ptr(), length)
        else:
            dest = import_torch().frombuffer(view, dtype=leaf.dtype, count=leaf.numel(), offset=offset)
            dest.view(leaf.shape).copy_(leaf)
    elif isinstance(leaf, np.ndarray):
        if leaf.flags.c_contiguous:
            ctypes.memmove(address + offset, leaf.__array_interface__["data"][0], length)
        else:
            dest = np.frombuffer(view, dtype=leaf.dtype, count=leaf.size, offset=offset)
            np.copyto(dest.reshape(leaf.shape), leaf)
    else:
        view[offset : offset + length] = leaf

def leaf_buffers(leaves: list[Any], lengths: list[int]) -> list[bytearray]:
    """Each leaf of `split` as its own buffer: the parts form of a payload, for tiny ones sent inline."""
    parts = []
    tensor = tensor_class()
    for leaf, length in zip(leaves, lengths, strict=True):
        part = bytearray(length)
        if length and type(leaf) is not PagePad:
            address = ctypes.addressof(ctypes.c_char.from_buffer(part))
            if type(leaf) is tensor and leaf.is_contiguous():
                ctypes.memmove(address, leaf.data_ptr(), length)  # the common case, without dispatch
            else:
                copy_leaf(leaf, memoryview(part), address, 0, length)
        parts.append(part)
    return parts



@dataclass(frozen=True, slots=True)
class Piece:
    """One run of a frame's bytes for a scatter write: `length` bytes of `source` belong at `offset`
    of the frame. `index` is the leaf's number in `FramePlan.leaves`, -1 for the head (prefix, buffer
    table and header). The bytes between pieces are padding, which no decoder reads."""

    offset: int
    length: int
    source: Any  # bytes (the head), or the leaf: a CPU tensor, a numpy array, bytes
    index: int

    @property
    def address(self) -> int | None:
        """Where the source's bytes lie, if they are one contiguous CPU run a transport can send as is."""
        return contiguous_address(self.source)

    def write_at(self, address: int) -> None:
        """Copy this piece's bytes to `address`, which the caller guarantees holds `length` mapped,
        writable bytes (the piece's own start, not the frame's)."""
        view = memoryview((ctypes.c_char * self.length).from_address(address)).cast("B")
        try:
            copy_leaf(self.source, view, address, 0, self.length)
        finally:
            view.release()


def contiguous_address(leaf: Any) -> int | None:
    """The address of a leaf whose bytes are one contiguous CPU run, else None."""
    if isinstance(leaf, tensor_class()):
        return leaf.data_ptr() if leaf.is_cpu and leaf.is_contiguous() else None
    if isinstance(leaf, np.ndarray):
        return leaf.__array_interface__["data"][0] if leaf.flags.c_contiguous else None
    return None
