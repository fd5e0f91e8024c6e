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
    EXT_FROZENSET,
    EXT_IMAGE,
    EXT_NDARRAY,
    EXT_NPSCALAR,
    EXT_SET,
    EXT_SLICE,
    EXT_TENSOR,
    EXT_TUPLE,
    MAX_TUPLE_DEPTH,
    FrameError,
    tuple_budget,
)
from omni_mesh.codec.image import ImageSlot
from omni_mesh.codec.nodes import (
    ArraySlot,
    BytesSlot,
    Const,
    DictNode,
    FlatDict,
    FlatList,
    FlatSet,
    ListNode,
    SetNode,
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
_CONSTANT = (str, int, float, bool, type(None), bytes, np.generic, frozenset, slice)
_SLICE_BOUNDS = (type(None), bool, int, float, str)

_SLOTS = (TensorSlot, ArraySlot, BytesSlot, CudaIpcSlot, DeviceTensorSlot, ImageSlot)
# Nodes whose values are unhashable, so a set never holds them (mutable sets are checked apart).
_NOT_IN_SETS = {
    ListNode: "list",
    FlatList: "list",
    DictNode: "dict",
    FlatDict: "dict",
    FlatSet: "set",
    ArraySlot: "numpy array",
    ImageSlot: "PIL image",
}


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
            return tuple(self.members(data, "tuple"))
        if code in (EXT_SET, EXT_FROZENSET):
            members = self.members(data, "set")
            if code == EXT_FROZENSET and all(_constant(member) for member in members):
                try:  # a constant frozenset is a value like a tuple: it may be a dict key
                    return frozenset(members)
                except TypeError:
                    raise FrameError("a set member is not hashable") from None
            return _Members(members, frozen=code == EXT_FROZENSET)
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
        if code == EXT_SLICE:
            bounds = ext_fields(fields, 3, "slice")
            if not all(type(bound) in _SLICE_BOUNDS for bound in bounds):
                raise FrameError(f"slice bounds {bounds!r} are not None, bool, int, float or str")
            return slice(*bounds)
        if code == EXT_IMAGE:
            return ImageSlot(fields)
        if code == EXT_NPSCALAR:
            dtype_str, raw = ext_fields(fields, 2, "numpy scalar")
            dtype = numpy_dtype(dtype_str)
            if not isinstance(raw, bytes) or len(raw) != dtype.itemsize:
                raise FrameError(f"numpy scalar of {dtype} needs {dtype.itemsize} bytes")
            return np.frombuffer(raw, dtype=dtype)[0]
        raise FrameError(f"unknown extension type {code}")

    def set_node(self, members: _Members) -> Any:
        children = [self.node(member) for member in members.items]
        for child in children:
            kind = _NOT_IN_SETS.get(type(child))
            if kind is None and type(child) is SetNode and not child.frozen:
                kind = "set"
            if kind is not None:
                raise FrameError(f"a set cannot hold a {kind}")
        if members.frozen or not all(type(child) is Const for child in children):
            return SetNode(children, members.frozen)
        try:
            return FlatSet(frozenset(child.value for child in children))
        except TypeError:
            raise FrameError("a set member is not hashable") from None

    def members(self, data: bytes, what: str) -> list:
        """The members of a tuple or set body, counted against the nesting depth and the budget."""
        self.depth += 1
        if self.depth > MAX_TUPLE_DEPTH:
            raise FrameError(f"tuples and sets nest deeper than {MAX_TUPLE_DEPTH}")
        self.tuple_budget -= len(data)
        if self.tuple_budget < 0:
            raise FrameError("tuple and set bodies exceed what the header size allows")
        items = self.unpack(data)
        self.depth -= 1
        if not isinstance(items, list):
            raise FrameError(f"{what} extension does not hold a list")
        return items

    def node(self, value: Any) -> Any:
        kind = type(value)
        if kind in _SLOTS:
            return value
        if kind is dict:
            for key in value:
                if type(key) is not str and not _constant(key):
                    raise FrameError("a dict key holds a buffer reference (tensor, array, image or bytes)")
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
        if kind is _Members:
            return self.set_node(value)
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


class _Members:
    """A set's members before compiling; unhashable, so a forged set used as a dict key fails."""

    __slots__ = ("items", "frozen")
    __hash__ = None  # type: ignore[assignment]

    def __init__(self, items: list, frozen: bool) -> None:
        self.items = items
        self.frozen = frozen


def _constant(value: Any) -> bool:
    """Whether a decoded header value holds no slot and no container a set could not keep."""
    if type(value) in (tuple, frozenset):
        return all(_constant(item) for item in value)
    return type(value) in _SLICE_BOUNDS or type(value) in (bytes, slice) or isinstance(value, np.generic)
