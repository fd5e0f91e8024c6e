"""A frame sent in pieces: large leaves from their own memory, the rest from a pool region.

A transfer engine can write from several sources in one batch. Large contiguous CPU leaves then need
no copy at put: the producer registers their memory and lays only the frame's head and small leaves
into its pool, packed (`codec.sparse_layout`); the engine writes every piece to its offset in the
consumer's region, which receives the same frame, byte for byte. A piece is (source address, offset
in the frame, bytes), in frame order.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from omni_mesh import codec

Piece = tuple[int, int, int]  # (source address, offset in the frame, bytes)


def leaf_address(leaf: Any) -> int | None:
    """Where a leaf's bytes lie, if they are one contiguous CPU run that can be sent as is."""
    if isinstance(leaf, torch.Tensor):
        return leaf.data_ptr() if leaf.is_cpu and leaf.is_contiguous() else None
    if isinstance(leaf, np.ndarray):
        return leaf.__array_interface__["data"][0] if leaf.flags.c_contiguous else None
    return None


def large_leaves(frame: codec.FramePlan, min_bytes: int, share: Callable[[int, int], bool]) -> dict[int, int]:
    """{leaf index: address} of the leaves of at least `min_bytes` to send from their own memory;
    `share(address, length)` registers one with the engine (False: it is copied into the pool)."""
    large: dict[int, int] = {}
    for index, (leaf, length) in enumerate(zip(frame.leaves, frame.lengths, strict=True)):
        if length >= min_bytes:
            address = leaf_address(leaf)
            if address is not None and share(address, length):
                large[index] = address
    return large


def lay_out(
    frame: codec.FramePlan, large: dict[int, int], reserve: Callable[[int], tuple[int, int]]
) -> tuple[int, list[Piece]]:
    """Lay the frame minus its large leaves into a region from `reserve(bytes) -> (offset, address)`;
    returns the region's offset and the frame's pieces. `reserve` frees nothing on failure: the
    caller frees the region if this raises after it."""
    runs, packed = codec.sparse_layout(frame, large)
    offset, base = reserve(packed)
    codec.write_sparse(frame, large, runs, base)
    pieces = [(base + at, start, end - start) for start, end, at in runs]
    pieces += [(address, frame.offsets[i], frame.lengths[i]) for i, address in large.items()]
    pieces.sort(key=lambda piece: piece[1])
    return offset, pieces


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
