"""Outputs allocated in a connector's memory (`connector.empty(shape, dtype)`): what the connectors
that keep a pool share.

`empty()` hands out a tensor over a region of the pool; a put whose payload holds that tensor as a
leaf sends it where it lies instead of copying it. Such a payload travels in the codec's parts form
(`codec.split`'s header, one buffer per leaf): the resident leaves straight from their regions, small
leaves inline, padding as empty buffers.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from omni_mesh import codec

#: empty() tensors smaller than this are ordinary ones: copying them costs less than a region.
MIN_BYTES = 64 * 1024
#: Leaf types the codec moves out of band; any other leaf of a frame is its padding (never referenced).
_DATA = (torch.Tensor, np.ndarray, bytes, bytearray, memoryview)


def nbytes_of(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"empty(): dtype must be a torch.dtype, got {dtype!r}")
    if any(n < 0 for n in shape):
        raise ValueError(f"empty(): negative dimension in shape {shape}")
    return math.prod(shape) * torch.empty((), dtype=dtype).element_size()


def tensor_over(buffer: Any, offset: int, shape: tuple[int, ...], dtype: torch.dtype) -> tuple[torch.Tensor, np.ndarray]:
    """A tensor over `nbytes_of(shape, dtype)` bytes of `buffer` at `offset`, and the array it views
    (its garbage collection says the tensor and all its views are gone)."""
    base = np.frombuffer(buffer, dtype=np.uint8, count=nbytes_of(shape, dtype), offset=offset)
    return torch.from_numpy(base).view(dtype).view(shape), base


def resident_leaves(frame: codec.FramePlan, unsent: dict[int, tuple[Any, int]]) -> dict[int, Any]:
    """{leaf index: region} of the frame's leaves that are whole empty() tensors, by `unsent`
    ({tensor address: (region, bytes)}). Views, slices and copies of them are ordinary leaves."""
    resident = {}
    for index, (leaf, length) in enumerate(zip(frame.leaves, frame.lengths, strict=True)):
        if type(leaf) is torch.Tensor and leaf.is_cpu:
            found = unsent.get(leaf.data_ptr())
            if found is not None and found[1] == length and leaf.is_contiguous():
                resident[index] = found[0]
    return resident


def is_padding(leaf: Any) -> bool:
    return not isinstance(leaf, _DATA)


def leaf_bytes(leaf: Any, length: int) -> bytearray:
    """A copy of one leaf (a small or non-resident one in the parts form)."""
    return codec.leaf_buffers([leaf], [length])[0]
