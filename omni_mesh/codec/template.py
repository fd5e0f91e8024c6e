"""The decode-template compiler: a frame header compiled once into a tree of nodes (see `nodes`),
cached by header bytes.
"""

from __future__ import annotations

from typing import Any

import msgpack
import numpy as np

from omni_mesh.codec.device import CudaIpcSlot, DeviceTensorSlot
from omni_mesh.codec.format import (
    EXT_BYTES,
    EXT_CUDA_IPC,
    EXT_DEVICE_TENSOR,
    EXT_NDARRAY,
    EXT_NPSCALAR,
    EXT_TENSOR,
    EXT_TUPLE,
    MAX_TUPLE_DEPTH,
    FrameError,
    tuple_budget,
)
from omni_mesh.codec.nodes import (
    ArraySlot,
    BytesSlot,
    Const,
    DictNode,
    FlatDict,
    FlatList,
    ListNode,
    TensorSlot,
    TupleNode,
    ext_fields,
    numpy_dtype,
)

# A header is compiled once into a template: a tree of nodes whose leaves are slots (a tensor of this
# dtype and shape in buffer i) and constants. Everything the header alone decides is validated then;
# each decode only checks the buffer table against the slots and builds fresh containers and views.
# Stage payloads repeat their structure request after request, so the cache turns decoding into a
# dict lookup plus one view per leaf.

TEMPLATE_CACHE_SIZE = 512
TEMPLATE_HEADER_MAX = 4096  # larger headers (long lists of numbers) are compiled each time, not kept
_TEMPLATES: dict[bytes, Any] = {}
_CONSTANT = (str, int, float, bool, type(None), bytes, np.generic)

_SLOTS = (TensorSlot, ArraySlot, BytesSlot, CudaIpcSlot, DeviceTensorSlot)


class _Compiler:
    """Turns a header into a template, validating everything the header alone decides."""

    def __init__(self, budget: int) -> None:
        self.cuda_slots = 0
        self.depth = 0
        self.tuple_budget = budget  # bytes of tuple bodies still allowed (see tuple_budget)

    def compile(self, header: bytes) -> Any:
        return self.node(self.unpack(header))

    def unpack(self, data: bytes) -> Any:
        # Ext type -1 is msgpack's timestamp, which msgpack decodes itself without calling ext_hook:
        # as a float (timestamp=1) it cannot bring a type into the tree that encode does not carry.
        return msgpack.unpackb(data, ext_hook=self.ext, raw=False, strict_map_key=False, use_list=True, timestamp=1)

    def ext(self, code: int, data: bytes) -> Any:
        if code == EXT_TUPLE:
            self.depth += 1
            if self.depth > MAX_TUPLE_DEPTH:
                raise FrameError(f"tuples nest deeper than {MAX_TUPLE_DEPTH}")
            self.tuple_budget -= len(data)
            if self.tuple_budget < 0:
                raise FrameError("tuple bodies exceed what the header size allows")
            items = self.unpack(data)
            self.depth -= 1
            if not isinstance(items, list):
                raise FrameError("tuple extension does not hold a list")
            return tuple(items)
        fields = msgpack.unpackb(data, raw=False)
        if code == EXT_TENSOR:
            return TensorSlot(*ext_fields(fields, 3, "tensor"))
        if code == EXT_NDARRAY:
            return ArraySlot(*ext_fields(fields, 3, "ndarray"))
        if code == EXT_BYTES:
            return BytesSlot(fields)
        if code == EXT_CUDA_IPC:
            self.cuda_slots += 1
            return CudaIpcSlot(fields)
        if code == EXT_DEVICE_TENSOR:
            return DeviceTensorSlot(*ext_fields(fields, 3, "device tensor"))
        if code == EXT_NPSCALAR:
            dtype_str, raw = ext_fields(fields, 2, "numpy scalar")
            dtype = numpy_dtype(dtype_str)
            if not isinstance(raw, bytes) or len(raw) != dtype.itemsize:
                raise FrameError(f"numpy scalar of {dtype} needs {dtype.itemsize} bytes")
            return np.frombuffer(raw, dtype=dtype)[0]
        raise FrameError(f"unknown extension type {code}")

    def node(self, value: Any) -> Any:
        kind = type(value)
        if kind in _SLOTS:
            return value
        if kind is dict:
            items = [(key, self.node(child)) for key, child in value.items()]
            if all(type(child) is Const for _, child in items):
                return FlatDict(value)
            return DictNode(items)
        if kind is list or kind is tuple:
            children = [self.node(child) for child in value]
            flat = all(type(child) is Const for child in children)
            if kind is tuple:
                return Const(value) if flat else TupleNode(children)
            return FlatList(value) if flat else ListNode(children)
        if isinstance(value, _CONSTANT):
            return Const(value)
        raise FrameError(f"unexpected {kind.__name__} in header")


def template_of(header: bytes, header_len: int) -> tuple[Any, bool]:
    """The compiled header, and whether it may be cached (CUDA IPC handles are unique to one put)."""
    template = _TEMPLATES.get(header)
    if template is not None:
        return template, True
    compiler = _Compiler(tuple_budget(header_len))
    template = compiler.compile(header)
    if compiler.cuda_slots:
        return template, False
    if header_len <= TEMPLATE_HEADER_MAX:
        if len(_TEMPLATES) >= TEMPLATE_CACHE_SIZE:
            _TEMPLATES.clear()  # hostile variety only costs recompiling, never memory
        _TEMPLATES[header] = template
    return template, True

