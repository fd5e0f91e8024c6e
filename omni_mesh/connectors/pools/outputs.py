"""Outputs allocated in a connector's memory (`connector.empty(shape, dtype)`): what the connectors
that keep a pool share.

`empty()` hands out a tensor over a region of the pool; a put whose payload holds that tensor as a
leaf sends it where it lies instead of copying it. Such a payload travels in the codec's parts form
(`codec.split`'s header, one buffer per leaf): the resident leaves straight from their regions, small
leaves inline, padding as empty buffers.
"""

from __future__ import annotations

import functools
import itertools
import math
import threading
import weakref
from typing import TYPE_CHECKING, Any

import numpy as np

from omni_mesh import codec
from omni_mesh.lazy_torch import import_torch, tensor_class

if TYPE_CHECKING:
    import torch

#: empty() tensors smaller than this are ordinary ones: copying them costs less than a region.
MIN_BYTES = 64 * 1024
#: Leaf types the codec moves out of band; any other leaf of a frame is its padding (never referenced).
_DATA = (np.ndarray, bytes, bytearray, memoryview)  # and tensors (tensor_class(): torch stays unimported)


def nbytes_of(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    torch = import_torch()  # empty() makes a tensor: torch is needed anyway
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
    return import_torch().from_numpy(base).view(dtype).view(shape), base


class Kinds:
    """Small numbers naming what empty() made (dtype, shape, and whatever else places a leaf): put
    layouts are cached by these, so a put hashes a few ints instead of torch sizes and dtypes. Never
    reused: an entry that outlives a clear keeps a number no new signature gets."""

    def __init__(self, limit: int = 256) -> None:
        self._kinds: dict[tuple, int] = {}
        self._ids = itertools.count()
        self._limit = limit
        self._lock = threading.Lock()  # empty() of several connectors may share one table (KINDS)

    def of(self, signature: tuple) -> tuple[int, bool]:
        """(the kind of `signature`, whether the table was cleared to make room: shapes vary with every
        request's length, so it is kept small)."""
        with self._lock:
            kind = self._kinds.get(signature)
            if kind is not None:
                return kind, False
            cleared = len(self._kinds) >= self._limit
            if cleared:
                self._kinds.clear()
            kind = self._kinds[signature] = next(self._ids)
            return kind, cleared


class ReadyPuts:
    """Puts of one empty() output alone, laid out at empty() as the last such put of an output of the
    same kind was (a stage puts its same-named output for every request), so that the put itself
    only checks that this is that put.

    The put runs right after the handler filled the tensor, with caches cold: each object it touches
    costs a trip to memory. `match` reads one dict entry and the four tensor fields that say the
    tensor is still exactly what empty() made (no in-place reshape, `set_` or transpose since).
    Thread-safe (single dict operations)."""

    def __init__(self, limit: int = 256) -> None:
        self._limit = limit  # kinds remembered: shapes vary with every request's length
        self._last: dict[int, tuple[str, Any]] = {}  # kind -> (dict key, the connector's layout)
        # id(tensor) -> (dict key, address, shape, dtype, the connector's laid-out put, weakref)
        self._ready: dict[int, tuple] = {}

    def last(self, kind: int) -> tuple[str, Any] | None:
        """(dict key, layout) of the last put of one output of `kind` alone, if any."""
        return self._last.get(kind)

    def remember(self, kind: int, name: str, layout: Any) -> None:
        if kind not in self._last and len(self._last) >= self._limit:
            self._last.clear()
        self._last[kind] = (name, layout)

    def forget_kinds(self) -> None:
        self._last.clear()

    def __len__(self) -> int:
        """Tensors laid out and alive."""
        return len(self._ready)

    def add(self, tensor: torch.Tensor, name: str, laid_out: Any) -> None:
        """`laid_out` is the put of {name: tensor}; forgotten when the tensor dies, before its id can
        name another object."""
        tensor_id = id(tensor)
        ref = weakref.ref(tensor, functools.partial(self._ready.pop, tensor_id))
        self._ready[tensor_id] = (name, tensor.data_ptr(), tensor.shape, tensor.dtype, laid_out, ref)

    def match(self, data: dict) -> Any:
        """The laid-out put of `data` if it is {name: tensor} as empty() laid it out, unchanged; None
        for anything else."""
        if len(data) != 1:
            return None
        [(name, value)] = data.items()
        ready = self._ready.get(id(value))  # a live object's id: this very tensor
        if ready is None or ready[0] != name:
            return None
        if (
            value.data_ptr() != ready[1]
            or value.dtype is not ready[3]
            or value.shape != ready[2]
            or not value.is_contiguous()
        ):
            return None
        return ready[4]


#: The kinds of (dtype, shape) behind the process-wide layout cache of `take_outputs`: one table for
#: every connector that uses it, so a kind number means the same thing in all of them.
KINDS = Kinds()


#: What a connector keeps for each empty() tensor not put yet, by the tensor's address: (its owner
#: (region, slot, ...), dtype and shape as empty() made them, kind).
Entry = tuple[Any, "torch.dtype", "torch.Size", int]


def match_whole(data: dict, live: dict[int, Entry]) -> tuple[tuple, list[int], list[Entry]] | None:
    """For a dict whose values are all whole empty() tensors found in `live`: (signature (key, kind,
    ...) naming its layout, their addresses, their entries); None for anything else.

    It reads a few fields of each tensor and nothing of its bytes: the put of empty() outputs runs
    right after the handler filled them, with caches cold."""
    signature: list[Any] = []
    addresses = []
    entries = []
    tensor = tensor_class()
    for key, value in data.items():
        if type(value) is not tensor:
            return None
        address = value.data_ptr()
        entry = live.get(address)
        if entry is None:
            return None
        # The dtype, shape and contiguity empty() made: exactly the region's bytes.
        if value.dtype is not entry[1] or value.shape != entry[2] or not value.is_contiguous():
            return None
        signature += (key, entry[3])
        addresses.append(address)
        entries.append(entry)
    return (tuple(signature), addresses, entries) if entries else None


def take_resident(frame: codec.FramePlan, unsent: dict[int, Entry]) -> dict[int, Any]:
    """{leaf index: owner} of the frame's leaves that are whole empty() tensors, taken out of `unsent`
    (the caller holds its lock). Views, slices and copies of them, and a second leaf of the same
    tensor, are ordinary leaves (copied)."""
    resident = {}
    tensor = tensor_class()
    for index, leaf in enumerate(frame.leaves):
        if type(leaf) is tensor:
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


# The signature of a dict of empty() tensors (match_whole, kinds from KINDS) -> its parts-form header, what each leaf of
# that form is (the index of a tensor among the dict's values, or -1 for padding), and its size.
_HEADERS: dict[tuple, tuple[bytes, list[int], int]] = {}


def take_outputs(
    data: dict, unsent: dict[int, Entry], *, max_header: int | None = None
) -> tuple[bytes, list[int], list[Any], int] | None:
    """A dict whose values are all whole empty() tensors (the usual stage output): its parts-form
    header, leaf layout, the tensors' owners, taken out of `unsent` (the caller holds its lock), and
    the payload's size. None for anything else, and for a header over `max_header` bytes (its keys
    are long strings: nothing is taken). No frame plan, no layout, no copy."""
    matched = match_whole(data, unsent)
    if matched is None:
        return None
    signature, addresses, entries = matched
    layout = _HEADERS.get(signature)
    if layout is None:
        header, leaves, _ = codec.split(data)
        index = {id(value): i for i, value in enumerate(data.values())}
        size = len(header) + sum(value.nbytes for value in data.values())
        layout = (header, [index.get(id(leaf), -1) for leaf in leaves], size)
        if len(_HEADERS) >= 256:
            _HEADERS.clear()
        _HEADERS[signature] = layout
    if max_header is not None and len(layout[0]) > max_header:
        return None
    for address in addresses:
        del unsent[address]
    return layout[0], layout[1], [entry[0] for entry in entries], layout[2]


def is_padding(leaf: Any) -> bool:
    return not isinstance(leaf, (tensor_class(), *_DATA))


def leaf_bytes(leaf: Any, length: int) -> bytearray:
    """A copy of one leaf (a small or non-resident one in the parts form)."""
    return codec.leaf_buffers([leaf], [length])[0]
