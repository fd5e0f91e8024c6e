"""The nodes of a decode template: containers, constants and slots (a leaf to take from buffer i).

Every node validates at construction what the header alone decides; `build(buffers)` makes a fresh
value per decode, views over the frame's buffers where it can.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import numpy as np

from omni_mesh.codec.format import MAX_NDIM, NUMPY_KINDS, FrameError, torch_dtypes
from omni_mesh.lazy_torch import import_torch

if TYPE_CHECKING:
    import torch


class Buffers:
    """The frame's buffers: `whole` is the caller's buffer object, which every view keeps alive;
    `device` the received device buffers, if the frame has device tensors."""

    __slots__ = ("whole", "base", "offsets", "lengths", "copy", "device", "cuda_local")

    def __init__(self, whole: Any, base: int, offsets: list[int], lengths: list[int], copy: bool) -> None:
        self.whole = whole
        self.base = base
        self.offsets = offsets
        self.lengths = lengths
        self.copy = copy
        self.device: list[torch.Tensor] | None = None
        self.cuda_local: Iterator[torch.Tensor] | None = None  # see decode(cuda_local=...)

    def length(self, index: int) -> int:
        return self.lengths[index] if index < len(self.lengths) else -1

    def locate(self, index: int, expected: int) -> tuple[Any, int]:
        """(buffer object, offset) of buffer `index`, checked to hold exactly `expected` bytes."""
        if index >= len(self.lengths):
            raise FrameError(f"buffer reference {index} out of range ({len(self.lengths)} buffers)")
        if self.lengths[index] != expected:
            raise FrameError(f"buffer {index} holds {self.lengths[index]} bytes, its leaf needs {expected}")
        return self.whole, self.base + self.offsets[index]


class Parts:
    """The buffers of the parts form: one buffer object per leaf."""

    __slots__ = ("parts", "copy")

    def __init__(self, parts: list[Any], copy: bool) -> None:
        self.parts = parts
        self.copy = copy

    def length(self, index: int) -> int:
        return memoryview(self.parts[index]).nbytes if index < len(self.parts) else -1

    def locate(self, index: int, expected: int) -> tuple[Any, int]:
        if index >= len(self.parts):
            raise FrameError(f"buffer reference {index} out of range ({len(self.parts)} buffers)")
        part = self.parts[index]
        if type(part) is bytearray and len(part) == expected:
            return part, 0  # the common case, in one process: writable, the right size
        with memoryview(part) as view:
            if view.nbytes != expected:
                raise FrameError(f"buffer {index} holds {view.nbytes} bytes, its leaf needs {expected}")
            if view.readonly and not self.copy:
                part = self.parts[index] = bytearray(view)  # views must be writable tensors
        return part, 0


class Const:
    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value

    def build(self, buffers: Buffers) -> Any:
        return self.value


class FlatList(Const):
    def build(self, buffers: Buffers) -> Any:
        return list(self.value)  # a fresh list: callers may mutate what they get


class FlatDict(Const):
    def build(self, buffers: Buffers) -> Any:
        return dict(self.value)


class ListNode:
    __slots__ = ("children",)

    def __init__(self, children: list) -> None:
        self.children = children

    def build(self, buffers: Buffers) -> Any:
        return [child.build(buffers) for child in self.children]


class TupleNode(ListNode):
    def build(self, buffers: Buffers) -> Any:
        return tuple([child.build(buffers) for child in self.children])


class FlatSet(Const):
    def build(self, buffers: Buffers) -> Any:
        return set(self.value)  # a fresh set: callers may mutate what they get


class SetNode:
    """A set or frozenset with members built per decode (tensors, large bytes, tuples of them)."""

    __slots__ = ("children", "frozen")

    def __init__(self, children: list, frozen: bool) -> None:
        self.children = children
        self.frozen = frozen

    def build(self, buffers: Buffers) -> Any:
        members = [child.build(buffers) for child in self.children]
        try:
            return frozenset(members) if self.frozen else set(members)
        except TypeError:  # only a forged frame puts an unhashable value in a set
            raise FrameError("a set member is not hashable") from None


class DictNode:
    __slots__ = ("items",)

    def __init__(self, items: list) -> None:
        self.items = items

    def build(self, buffers: Buffers) -> Any:
        return {key: child.build(buffers) for key, child in self.items}


class TensorSlot:
    __slots__ = ("dtype", "shape", "numel", "nbytes", "index")

    def __init__(self, name: Any, shape: Any, index: Any) -> None:
        self.dtype = dtype = torch_dtype(name)
        self.shape = checked_shape(shape)
        self.numel = math.prod(self.shape)
        self.nbytes = self.numel * dtype.itemsize
        self.index = buffer_index(index)

    def build(self, buffers: Buffers) -> torch.Tensor:
        whole, start = buffers.locate(self.index, self.nbytes)
        torch = import_torch()  # loaded already: torch_dtype() built this slot's dtype
        if self.numel == 0:
            return torch.empty(self.shape, dtype=self.dtype)
        tensor = torch.frombuffer(whole, dtype=self.dtype, count=self.numel, offset=start)
        if len(self.shape) != 1:
            tensor = tensor.view(self.shape)
        return tensor.clone() if buffers.copy else tensor


class ArraySlot:
    __slots__ = ("dtype", "shape", "numel", "nbytes", "index")

    def __init__(self, dtype_str: Any, shape: Any, index: Any) -> None:
        self.dtype = numpy_dtype(dtype_str)
        self.shape = checked_shape(shape)
        self.numel = math.prod(self.shape)
        self.nbytes = self.numel * self.dtype.itemsize
        self.index = buffer_index(index)

    def build(self, buffers: Buffers) -> np.ndarray:
        whole, start = buffers.locate(self.index, self.nbytes)
        if self.numel == 0:
            return np.empty(self.shape, dtype=self.dtype)
        array = np.frombuffer(whole, dtype=self.dtype, count=self.numel, offset=start).reshape(self.shape)
        return array.copy() if buffers.copy else array


class BytesSlot:
    __slots__ = ("index",)

    def __init__(self, index: Any) -> None:
        self.index = buffer_index(index)

    def build(self, buffers: Buffers) -> bytes:
        length = buffers.length(self.index)
        whole, start = buffers.locate(self.index, length)
        with memoryview(whole) as view:
            return bytes(view.cast("B")[start : start + length])


def torch_dtype(name: Any) -> torch.dtype:
    """The dtype a header names; the first frame that names one imports torch (see omni_mesh.lazy_torch)."""
    dtype = torch_dtypes().get(name) if type(name) is str else None
    if dtype is None:
        raise FrameError(f"unknown tensor dtype {name!r}")
    return dtype


def buffer_index(index: Any) -> int:
    if type(index) is not int or index < 0:
        raise FrameError(f"buffer reference {index!r} is not a buffer index")
    return index


def ext_fields(fields: Any, count: int, what: str) -> list[Any]:
    if not isinstance(fields, list) or len(fields) != count:
        raise FrameError(f"{what} extension needs {count} fields")
    return fields


def checked_shape(shape: Any) -> tuple[int, ...]:
    if type(shape) is not list or len(shape) > MAX_NDIM:
        raise FrameError(f"bad shape {shape!r}")
    for dim in shape:
        if type(dim) is not int or not 0 <= dim < 2**62:
            raise FrameError(f"bad shape {shape!r}")
    return tuple(shape)


def numpy_dtype(text: Any) -> np.dtype:
    if not isinstance(text, str) or len(text) > 16:
        raise FrameError(f"bad numpy dtype {text!r}")
    try:
        dtype = np.dtype(text)
    except TypeError:
        raise FrameError(f"bad numpy dtype {text!r}") from None
    if dtype.kind not in NUMPY_KINDS or dtype.hasobject or dtype.fields or dtype.subdtype or dtype.itemsize == 0:
        raise FrameError(f"numpy dtype {text!r} is not allowed")
    return dtype
