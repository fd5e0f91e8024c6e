"""A frame sent in pieces: large leaves from their own memory, the rest from a pool region.

A transfer engine can write from several sources in one batch. Large contiguous CPU leaves then need
no copy at put: the producer registers their memory and lays only the frame's head and small leaves
into its pool, packed (from the codec's scatter form, `FramePlan.pieces()`); the engine writes every
piece to its offset in the consumer's region, which receives the same frame, byte for byte. A piece
here is (source address, offset in the frame, bytes), in frame order.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable

import torch

from omni_mesh import codec

Piece = tuple[int, int, int]  # (source address, offset in the frame, bytes)


def large_leaves(
    frame: codec.FramePlan, min_bytes: int, share: Callable[[int, int], bool]
) -> dict[int, codec.Piece]:
    """{leaf index: piece} of the leaves of at least `min_bytes` to send from their own memory;
    `share(address, length)` registers one with the engine (False: it is copied into the pool)."""
    large: dict[int, codec.Piece] = {}
    for piece in frame.pieces():
        if piece.index >= 0 and piece.length >= min_bytes:
            address = piece.address
            if address is not None and share(address, piece.length):
                large[piece.index] = piece
    return large


def lay_out(
    frame: codec.FramePlan, large: dict[int, codec.Piece], reserve: Callable[[int], tuple[int, int]]
) -> tuple[int, list[Piece]]:
    """Lay the frame minus its large leaves into a region from `reserve(bytes) -> (offset, address)`;
    returns the region's offset and the frame's pieces. `reserve` frees nothing on failure: the
    caller frees the region if this raises after it."""
    small = [piece for piece in frame.pieces() if piece.index not in large]
    runs, packed = _pack_runs(small)
    offset, base = reserve(packed)
    for piece, at in zip(small, runs, strict=True):
        piece.write_at(base + at)
    pieces = _merge([(base + at, piece.offset, piece.length) for piece, at in zip(small, runs, strict=True)])
    pieces += [(piece.address, piece.offset, piece.length) for piece in large.values()]
    pieces.sort(key=lambda piece: piece[1])
    return offset, pieces


def _pack_runs(pieces: list[codec.Piece]) -> tuple[list[int], int]:
    """Where each piece goes in the packed region, and the region's size. Pieces that lie back to
    back in the frame (at most alignment padding between them) keep their spacing, so the engine
    moves them as one run; every piece keeps its frame offset modulo ALIGN, so leaves stay aligned."""
    places: list[int] = []
    pos = end = 0
    for piece in pieces:
        if places and piece.offset - end < codec.ALIGN:  # spaced as in the frame, after the one before
            at = pos + piece.offset - end
        else:
            at = codec.align(pos) + piece.offset % codec.ALIGN
        places.append(at)
        pos, end = at + piece.length, piece.offset + piece.length
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
