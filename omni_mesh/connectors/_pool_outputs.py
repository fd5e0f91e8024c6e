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


def tensor_over(
    buffer: Any, offset: int, shape: tuple[int, ...], dtype: torch.dtype
) -> tuple[torch.Tensor, np.ndarray]:
    """A tensor over `nbytes_of(shape, dtype)` bytes of `buffer` at `offset`, and the array it views
    (its garbage collection says the tensor and all its views are gone)."""
    base = np.frombuffer(buffer, dtype=np.uint8, count=nbytes_of(shape, dtype), offset=offset)
    return torch.from_numpy(base).view(dtype).view(shape), base


def take_resident(
    frame: codec.FramePlan, unsent: dict[int, tuple[Any, torch.dtype, torch.Size]]
) -> dict[int, Any]:
    """{leaf index: region} of the frame's leaves that are whole empty() tensors, taken out of `unsent`
    ({tensor address: (region, dtype, shape)}; the caller holds its lock). Views, slices and copies
    of them, and a second leaf of the same tensor, are ordinary leaves (copied)."""
    resident = {}
    for index, leaf in enumerate(frame.leaves):
        if type(leaf) is torch.Tensor:
            address = leaf.data_ptr()
            found = unsent.get(address)
            if (
                found is not None
                and leaf.dtype is found[1]
                and leaf.shape == found[2]
                and leaf.is_contiguous()
            ):
                del unsent[address]
                resident[index] = found[0]
    return resident


# (key, dtype, shape, ...) of a dict of empty() tensors -> its parts-form header, and what each leaf of
# that form is: the index of a tensor among the dict's values, or -1 for padding.
_HEADERS: dict[tuple, tuple[bytes, list[int]]] = {}


def take_outputs(
    data: dict, unsent: dict[int, tuple[Any, torch.dtype, torch.Size]]
) -> tuple[bytes, list[int], list[Any]] | None:
    """A dict whose values are all whole empty() tensors (the usual stage output, a dict of tensors):
    its parts-form header, leaf layout and the tensors' regions, taken out of `unsent` ({address:
    (region, dtype, shape)}; the caller holds its lock). None for anything else.

    The put of such a payload reads a few fields of each tensor and nothing of its bytes: no frame
    plan, no layout, no copy (it runs right after the handler filled the tensor, with caches cold).
    """
    signature: list[Any] = []
    addresses = []
    for key, value in data.items():
        if type(value) is not torch.Tensor:
            return None
        address = value.data_ptr()
        entry = unsent.get(address)
        if entry is None:
            return None
        dtype, shape = value.dtype, value.shape
        # The same dtype, shape and contiguity as empty() made: exactly the region's bytes.
        if dtype is not entry[1] or shape != entry[2] or not value.is_contiguous():
            return None
        signature += (key, dtype, shape)
        addresses.append(address)
    if not addresses:
        return None
    key = tuple(signature)
    layout = _HEADERS.get(key)
    if layout is None:
        header, leaves, _ = codec.split(data)
        index = {id(value): i for i, value in enumerate(data.values())}
        layout = (header, [index.get(id(leaf), -1) for leaf in leaves])
        if len(_HEADERS) >= 256:
            _HEADERS.clear()
        _HEADERS[key] = layout
    return layout[0], layout[1], [unsent.pop(address)[0] for address in addresses]


def is_padding(leaf: Any) -> bool:
    return not isinstance(leaf, _DATA)


def leaf_bytes(leaf: Any, length: int) -> bytearray:
    """A copy of one leaf (a small or non-resident one in the parts form)."""
    return codec.leaf_buffers([leaf], [length])[0]
