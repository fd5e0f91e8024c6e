"""A frame sent in pieces: large leaves from their own memory, the rest from a pool region.

A transfer engine can write from several sources in one batch. Large contiguous CPU leaves then need
no copy at put: the producer registers their memory and lays only the frame's head and small leaves
into its pool, packed (from the codec's scatter form, `FramePlan.pieces()`); the engine writes every
piece to its offset in the consumer's region, which receives the same frame, byte for byte. A piece
here is (source address, offset in the frame, bytes), in frame order.

Small pieces (the head, small leaves: at most INLINE_BYTES in all) ride the producer's answer instead
(`split_inline`, `place_inline`): an engine write of a few KiB beside a large one cost ~0.5 ms of a
16 MiB get over TCP, and a frame that small needs no engine write at all.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from typing import Any

import msgpack
import torch

from omni_mesh import codec
from omni_mesh.codec.frame import PagePad, contiguous_address

Piece = tuple[int, int, int]  # (source address, offset in the frame, bytes)
# At most this much of a frame rides the answer: under the side channel's 64 KiB message cap.
INLINE_BYTES = 32 * 1024


def scatter(
    frame: codec.FramePlan,
    min_bytes: int,
    share: Callable[[int, int], bool],
    reserve: Callable[[int], tuple[int, int]],
) -> tuple[int, list[Piece], list[Any]] | None:
    """Send the frame's contiguous leaves of at least `min_bytes` from their own memory, where
    `share(address, length)` lets the engine read them (False: that leaf is copied), and lay the rest
    (head, small leaves) into a region from `reserve(bytes) -> (offset, address)`, packed.

    Returns (the region's offset, the frame's pieces, the leaves sent from their own memory), or
    None when no leaf is (the caller lays the whole frame). `reserve` frees nothing on failure: the
    caller frees the region if this raises after it. The packing of a frame's small part is cached,
    so the put of an `empty()` output costs a lookup, not a layout.
    """
    leaves, offsets, lengths = frame.leaves, frame.offsets, frame.lengths
    large: list[tuple[int, int]] = []  # (leaf index, address)
    for index, length in enumerate(lengths):
        if length >= min_bytes and type(leaves[index]) is not PagePad:
            address = contiguous_address(leaves[index])
            if address is not None and share(address, length):
                large.append((index, address))
    if not large:
        return None
    key = (frame.head, tuple(index for index, _ in large))
    layout = _SMALL_PARTS.get(key)
    if layout is None:
        layout = _small_part(frame, {index for index, _ in large})
        if len(_SMALL_PARTS) >= 256:
            _SMALL_PARTS.clear()
        _SMALL_PARTS[key] = layout
    writes, packed, runs = layout
    offset, base = reserve(packed)
    for index, at, length in writes:
        if index < 0:
            ctypes.memmove(base + at, frame.head, length)  # the head: one memmove, no buffer export
        else:
            codec.Piece(offsets[index], length, leaves[index], index).write_at(base + at)
    pieces = [(base + at, frame_offset, size) for at, frame_offset, size in runs]
    pieces += [(address, offsets[index], lengths[index]) for index, address in large]
    pieces.sort(key=_frame_offset)
    return offset, pieces, [leaves[index] for index, _ in large]


# (frame head, indices of the leaves sent from their own memory) -> the small part's packing.
_SMALL_PARTS: dict[tuple[bytes, tuple[int, ...]], tuple[list[tuple[int, int, int]], int, list[Piece]]] = {}


def _frame_offset(piece: Piece) -> int:
    return piece[1]


def _small_part(frame: codec.FramePlan, large: set[int]) -> tuple[list[tuple[int, int, int]], int, list[Piece]]:
    """How the head and the small leaves pack into one region: the writes (leaf index or -1 for the
    head, place in the region, bytes), the region's size, and its runs as pieces relative to the
    region's start (merged: pieces spaced as in the frame move as one)."""
    small = [(-1, 0, len(frame.head))]
    placed = zip(frame.leaves, frame.offsets, frame.lengths, strict=True)
    for index, (leaf, offset, length) in enumerate(placed):
        if length and type(leaf) is not PagePad and index not in large:
            small.append((index, offset, length))
    places, packed = _pack_runs([(offset, length) for _, offset, length in small])
    writes = [(index, at, length) for (index, _, length), at in zip(small, places, strict=True)]
    runs = _merge([(at, offset, length) for (_, offset, length), at in zip(small, places, strict=True)])
    return writes, packed, runs


def _pack_runs(spans: list[tuple[int, int]]) -> tuple[list[int], int]:
    """Where each (frame offset, bytes) span goes in the packed region, and the region's size. Spans
    that lie back to back in the frame (at most alignment padding between them) keep their spacing,
    so the engine moves them as one run; every span keeps its frame offset modulo ALIGN, so leaves
    stay aligned."""
    places: list[int] = []
    pos = end = 0
    for offset, length in spans:
        if places and offset - end < codec.ALIGN:  # spaced as in the frame, after the one before
            at = pos + offset - end
        else:
            at = codec.align(pos) + offset % codec.ALIGN
        places.append(at)
        pos, end = at + length, offset + length
    return places, pos


def _merge(pieces: list[Piece]) -> list[Piece]:
    """Adjacent pieces whose sources and frame offsets are spaced alike, as one move each."""
    merged: list[Piece] = []
    for source, at, size in pieces:
        if merged:
            last_source, last_at, last_size = merged[-1]
            gap = at - (last_at + last_size)
            if 0 <= gap < codec.ALIGN and source - last_source == at - last_at:
                merged[-1] = (last_source, last_at, at + size - last_at)
                continue
        merged.append((source, at, size))
    return merged


def assemble(pieces: list[Piece], address: int) -> None:
    """Copy the pieces into one frame at `address` (a consumer in the producer's own process)."""
    for source, at, size in pieces:
        ctypes.memmove(address + at, source, size)


def moves(
    pieces: list[Piece], address: int, device: list[torch.Tensor], device_addresses: list[int]
) -> tuple[list[int], list[int], list[int]]:
    """The engine's batch write delivering the pieces to a frame at `address` and each device
    tensor to its receive buffer: (sources, targets, sizes), empty pieces left out."""
    batch = [(source, address + at, size) for source, at, size in pieces]
    batch += [(t.data_ptr(), target, t.nbytes) for t, target in zip(device, device_addresses, strict=True)]
    batch = [move for move in batch if move[2]]
    return [m[0] for m in batch], [m[1] for m in batch], [m[2] for m in batch]


def split_inline(pieces: list[Piece]) -> tuple[list[Piece], bytes | None]:
    """The pieces the engine writes, and the small ones' bytes for the answer (msgpack [[frame offset,
    bytes], ...]; None when there are none). Read before the payload's memory goes back."""
    written: list[Piece] = []
    inline: list[list[Any]] = []
    room = INLINE_BYTES
    for source, at, size in pieces:
        if 0 < size <= room:
            inline.append([at, ctypes.string_at(source, size)])
            room -= size
        else:
            written.append((source, at, size))
    return written, (msgpack.packb(inline) if inline else None)


def place_inline(packed: bytes, address: int, length: int) -> None:
    """Copy the pieces an answer carried into the frame at `address` (`length` bytes). Untrusted bytes:
    ValueError unless every piece is [offset, bytes] inside the frame, INLINE_BYTES at most in all."""
    try:
        inline = msgpack.unpackb(packed, raw=False) if len(packed) <= 2 * INLINE_BYTES else None
    except ValueError:  # msgpack's errors are ValueErrors
        inline = None
    if not isinstance(inline, list):
        raise ValueError("malformed inline pieces")
    checked = []
    for piece in inline:
        if not (isinstance(piece, list) and len(piece) == 2 and type(piece[0]) is int):
            raise ValueError("malformed inline piece")
        at, data = piece
        if type(data) is not bytes:
            raise ValueError("malformed inline piece")
        if at < 0 or at + len(data) > length:
            raise ValueError(f"a piece at {at} of {len(data)} bytes lies outside the {length}-byte frame")
        checked.append((at, data))
    if sum(len(data) for _, data in checked) > INLINE_BYTES:
        raise ValueError("more inline bytes than a producer may send")
    for at, data in checked:
        ctypes.memmove(address + at, data, len(data))
