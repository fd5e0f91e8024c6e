"""Encoding: the walker that turns an object tree into a msgpack header and out-of-band leaves, and
the planners built on it (`split`, `plan`, `encode`).

There is no pickle anywhere; only the types listed in `omni_mesh.codec` round-trip, and a value of
any other type is refused with UnsupportedTypeError naming it and where it is.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import TYPE_CHECKING, Any

import msgpack
import numpy as np

from omni_mesh.codec import image
from omni_mesh.codec.device import CudaIpcExports, DeviceLeaves
from omni_mesh.codec.format import (
    ALIGN,
    EXT_BYTES,
    EXT_FROZENSET,
    EXT_IMAGE,
    EXT_NDARRAY,
    EXT_NPSCALAR,
    EXT_SET,
    EXT_SLICE,
    EXT_TENSOR,
    EXT_TUPLE,
    INLINE_BYTES_MAX,
    MAX_TUPLE_DEPTH,
    NUMPY_KINDS,
    PAGE,
    PAGE_MATCH_MIN,
    UnsupportedTypeError,
    dtype_names,
    pack,
    tuple_budget,
)
from omni_mesh.codec.frame import LAYOUT_CACHE_SIZE, FramePlan, PagePad
from omni_mesh.lazy_torch import NoTensor, import_torch, loaded_torch, tensor_class

if TYPE_CHECKING:
    import torch


def split(obj: Any, *, device: CudaIpcExports | DeviceLeaves | None = None) -> tuple[bytes, list[Any], list[int]]:
    """The msgpack header of `obj` and its out-of-band leaves (with their sizes), before any layout.

    CUDA tensors are copied to host memory, unless a `device` policy takes them (CudaIpcExports,
    DeviceLeaves). Raises UnsupportedTypeError naming the value it cannot carry and where.
    """
    walker = _Walker(device)
    try:
        header = pack(walker.convert(obj))
    except (UnsupportedTypeError, UnicodeEncodeError) as exc:
        message = str(exc) if isinstance(exc, UnsupportedTypeError) else _not_utf8(exc)
        try:
            where = _find_unsupported(obj, "payload")
        except RecursionError:
            where = None
        raise UnsupportedTypeError(f"{message} at {where}" if where else message) from None
    except RecursionError:
        raise UnsupportedTypeError("payload nests too deeply to encode") from None
    if walker.tuple_bytes > tuple_budget(len(header)):
        raise UnsupportedTypeError(
            f"tuples nested in tuples hold {walker.tuple_bytes} bytes for a {len(header)}-byte header, more "
            f"than decoders accept ({tuple_budget(len(header))}); nest lists instead"
        )
    return header, walker.leaves, walker.lengths


def plan(obj: Any, *, device: CudaIpcExports | DeviceLeaves | None = None) -> FramePlan:
    """Plan `obj` into a frame. Raises UnsupportedTypeError naming the value it cannot carry and where."""
    if type(obj) is dict and (device is None or type(device) is CudaIpcExports):  # it never takes CPU tensors
        frame = _flat_plan(obj)
        if frame is not None:
            return frame
    return FramePlan(*split(obj, device=device))


# Plans of dicts of host tensors by (key, dtype, shape, page offset) per item: the usual stage payload,
# planned once per structure instead of walked, packed and laid out on every put.
_FLAT_PLANS: dict[tuple, tuple[FramePlan, tuple[PagePad | None, ...]]] = {}


def plan_flat(obj: Any) -> FramePlan | None:
    """The plan of a dict of contiguous CPU tensors with str keys (the usual stage payload), from the
    cache; None for anything else, which `plan` takes. No device policy is needed: it holds none."""
    return _flat_plan(obj) if type(obj) is dict else None


def _flat_plan(obj: dict) -> FramePlan | None:
    """The plan of a dict of contiguous CPU tensors with str keys, from the cache; None for anything else."""
    torch = loaded_torch()
    if torch is None:
        return None  # no torch here, so no tensor either
    tensor, strided = torch.Tensor, torch.strided
    signature: list[Any] = []
    tensors = []
    for key, value in obj.items():
        if (
            type(key) is not str
            or type(value) is not tensor
            or not (value.is_cpu and value.layout is strided and value.is_contiguous())
            or value.is_nested
            or value.is_conj()
            or value.is_neg()
        ):
            return None
        page_offset = (value.data_ptr() - ALIGN) % PAGE & ~(ALIGN - 1) if value.nbytes >= PAGE_MATCH_MIN else -1
        signature += (key, value.dtype, value.shape, page_offset)
        tensors.append(value)
    key = tuple(signature)
    cached = _FLAT_PLANS.get(key)
    if cached is None:
        names = dtype_names()
        if any(names.get(t.dtype) is None for t in tensors):
            return None  # the general path names the dtype it cannot carry
        model = FramePlan(*split(obj))
        pads = tuple(leaf if type(leaf) is PagePad else None for leaf in model.leaves)
        model.leaves = []  # the cache must not keep this payload's tensors alive
        if len(_FLAT_PLANS) >= LAYOUT_CACHE_SIZE:
            _FLAT_PLANS.clear()
        cached = _FLAT_PLANS[key] = (model, pads)
    model, pads = cached
    frame = FramePlan.__new__(FramePlan)
    frame.header, frame.lengths, frame.offsets, frame.nbytes, frame.head = (
        model.header,
        model.lengths,
        model.offsets,
        model.nbytes,
        model.head,
    )
    frame.payload_bytes = model.payload_bytes
    # The model's pads (shared, immutable) with this payload's tensors between them.
    source = iter(tensors)
    frame.leaves = [next(source) if pad is None else pad for pad in pads]
    return frame


@functools.lru_cache(maxsize=1024)
def _tensor_ext(name: str, shape: torch.Size, index: int) -> msgpack.ExtType:
    """The header entry of a tensor leaf; payloads repeat their shapes, so it is packed once."""
    return msgpack.ExtType(EXT_TENSOR, pack([name, list(shape), index]))


def _not_utf8(exc: UnicodeEncodeError) -> str:
    return f"cannot encode a str that is not valid UTF-8 ({exc.reason})"


_NATIVE = (str, float, bool, type(None))
_SLICE_BOUNDS = (type(None), bool, int, float, str)


class _Walker:
    """Turns an object tree into a msgpack-native tree, moving large leaves out of band."""

    def __init__(self, device: CudaIpcExports | DeviceLeaves | None = None) -> None:
        self.device = device
        self.tensor_class = tensor_class()  # NoTensor where torch was never imported: nothing is a tensor
        if self.tensor_class is not NoTensor:  # what tensor() reads per leaf, looked up once
            self.strided, self.dtype_names = import_torch().strided, dtype_names()
        self.leaves: list[Any] = []
        self.lengths: list[int] = []
        self.depth = 0  # of tuples and sets, as the decoder counts them
        self.in_set = 0  # > 0 inside a set, whose members must stay hashable once decoded
        self.in_key = 0  # > 0 inside a dict key, which must decode to itself: no leaf, no dataclass
        self.tuple_bytes = 0

    def leaf(self, leaf: Any, nbytes: int, address: int | None = None) -> int:
        if self.in_key:
            raise UnsupportedTypeError(
                f"cannot encode a {type(leaf).__qualname__} in a dict key: keys carry no tensors, arrays, "
                f"images or bytes over {INLINE_BYTES_MAX} bytes"
            )
        if address is not None and nbytes >= PAGE_MATCH_MIN:
            self.leaves.append(PagePad(address))
            self.lengths.append(0)  # sized when the frame is laid out
        self.leaves.append(leaf)
        self.lengths.append(nbytes)
        return len(self.leaves) - 1

    def convert(self, value: Any) -> Any:
        kind = type(value)
        if kind in _NATIVE:
            return value
        if kind is self.tensor_class:  # the usual leaf, ahead of the container checks
            return self.tensor(value)
        if kind is int:
            if not -(2**63) <= value < 2**64:
                raise UnsupportedTypeError(f"cannot encode the integer {value}: it does not fit in 64 bits")
            return value
        if kind is dict:
            return {(k if type(k) is str else self.key(k)): self.convert(v) for k, v in value.items()}
        if kind is list:
            return [self.convert(v) for v in value]
        if kind is tuple:
            return self.members(EXT_TUPLE, value)
        if kind is bytes:
            if len(value) <= INLINE_BYTES_MAX:
                return value
            return msgpack.ExtType(EXT_BYTES, pack(self.leaf(value, len(value))))
        if isinstance(value, self.tensor_class):
            return self.tensor(value)
        if isinstance(value, np.ndarray):
            return self.ndarray(value)
        if isinstance(value, np.generic) and value.dtype.kind in NUMPY_KINDS:
            dtype, raw = value.dtype, value.tobytes()
            if not dtype.itemsize:  # np.str_("") or np.bytes_(b""): one NUL element, which numpy strips
                dtype, raw = np.dtype(dtype.kind + "1"), bytes(np.dtype(dtype.kind + "1").itemsize)
            return msgpack.ExtType(EXT_NPSCALAR, pack([dtype.str, raw]))
        if kind is set or kind is frozenset:
            self.in_set += 1
            entry = self.members(EXT_SET if kind is set else EXT_FROZENSET, value)
            self.in_set -= 1
            return entry
        if kind is slice:
            return self.slice(value)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            return self.dataclass(value)
        image_class = image.image_class()
        if image_class is not None and isinstance(value, image_class):
            return self.image(value)
        # Subclasses (OrderedDict, IntEnum, str enums, namedtuples, torch.Size) travel as their base.
        for base in (bool, int, float, str, bytes, dict, list, tuple, set, frozenset):
            if isinstance(value, base):
                # str() of a str-mixin enum member is "Cls.NAME", not its value: take the str itself.
                return self.convert(str.__str__(value) if base is str else base(value))
        if isinstance(value, (bytearray, memoryview)):
            return self.convert(bytes(value))
        raise UnsupportedTypeError(f"cannot encode a value of type {kind.__qualname__}")

    def key(self, key: Any) -> Any:
        self.in_key += 1
        converted = self.convert(key)
        self.in_key -= 1
        return converted

    def members(self, code: int, items: Any) -> msgpack.ExtType:
        """A tuple or set: its members packed as a list inside the extension, as deep as decoders allow."""
        self.depth += 1
        if self.depth > MAX_TUPLE_DEPTH:
            raise UnsupportedTypeError(f"tuples and sets nest deeper than {MAX_TUPLE_DEPTH}")
        body = pack([self.convert(v) for v in items])
        self.depth -= 1
        self.tuple_bytes += len(body)
        return msgpack.ExtType(code, body)

    def slice(self, value: slice) -> msgpack.ExtType:
        bounds = [value.start, value.stop, value.step]
        for bound in bounds:
            if type(bound) not in _SLICE_BOUNDS:
                raise UnsupportedTypeError(
                    f"cannot encode a slice bound of type {type(bound).__qualname__} "
                    "(bounds may be None, bool, int, float or str)"
                )
        return msgpack.ExtType(EXT_SLICE, pack([self.convert(bound) for bound in bounds]))

    def dataclass(self, value: Any) -> dict:
        """A dataclass instance as the dict of its fields (as vllm-omni sends it): the decoding side
        never imports the class. Fields are converted as they are, not deep-copied like asdict()."""
        if self.in_set or self.in_key:
            inside = "a set" if self.in_set else "a dict key"
            raise UnsupportedTypeError(
                f"cannot encode a {type(value).__qualname__} inside {inside}: it arrives as a dict, which is "
                "not hashable"
            )
        return {field.name: self.convert(getattr(value, field.name)) for field in dataclasses.fields(value)}

    def image(self, value: Any) -> msgpack.ExtType:
        mode, size, raw, palette = image.encode_fields(value)
        index = self.leaf(raw, len(raw))
        return msgpack.ExtType(EXT_IMAGE, pack([mode, size, index, palette]))

    def tensor(self, tensor: torch.Tensor) -> msgpack.ExtType:
        name = self.dtype_names.get(tensor.dtype)
        strided = self.strided
        if self.device is not None and name is not None and self.device.wants(tensor):
            return self.device_entry(name, tensor)
        if (
            name is not None
            and tensor.is_cpu
            and tensor.layout is strided
            and not (tensor.is_nested or tensor.is_conj() or tensor.is_neg())
            and tensor.is_contiguous()
        ):  # the common case, checked in one go: the leaf is copied from data_ptr as it stands
            index = self.leaf(tensor, tensor.nbytes, tensor.data_ptr())
            return _tensor_ext(name, tensor.shape, index)
        if name is None:
            raise UnsupportedTypeError(f"cannot encode a tensor of dtype {tensor.dtype}; convert it first")
        if tensor.layout is not strided or tensor.is_nested:
            if tensor.is_nested:
                raise UnsupportedTypeError("cannot encode a nested tensor; send the list .unbind() gives")
            raise UnsupportedTypeError(f"cannot encode a {tensor.layout} tensor; convert it with .to_dense()")
        if tensor.requires_grad:
            tensor = tensor.detach()
        if not tensor.is_cpu:
            if tensor.is_meta:
                raise UnsupportedTypeError("cannot encode a tensor on the meta device: it has no data")
            tensor = tensor.cpu()
        if tensor.is_conj() or tensor.is_neg():
            tensor = tensor.resolve_conj().resolve_neg()
        address = tensor.data_ptr() if tensor.is_contiguous() else None
        index = self.leaf(tensor, tensor.nbytes, address)
        return _tensor_ext(name, tensor.shape, index)

    def device_entry(self, name: str, tensor: torch.Tensor) -> msgpack.ExtType:
        if self.in_key:
            raise UnsupportedTypeError(f"cannot encode a {tensor.device} tensor in a dict key")
        if tensor.layout is not self.strided or tensor.is_nested:
            raise UnsupportedTypeError(f"cannot send a {tensor.layout} tensor device to device; convert it first")
        tensor = tensor.detach()
        if tensor.is_conj() or tensor.is_neg():
            tensor = tensor.resolve_conj().resolve_neg()  # the bits live on the tensor, not in its memory
        try:
            return self.device.entry(name, tensor)
        except (RuntimeError, ValueError) as exc:
            raise UnsupportedTypeError(
                f"cannot send a {tensor.device} tensor device to device ({exc}); turn the connector's "
                "device path off (cuda_ipc / device_transfer: false) to send it through host memory"
            ) from None

    def ndarray(self, array: np.ndarray) -> msgpack.ExtType:
        dtype = array.dtype
        if dtype.kind not in NUMPY_KINDS or dtype.hasobject or dtype.fields or dtype.subdtype:
            raise UnsupportedTypeError(f"cannot encode a numpy array of dtype {dtype}")
        address = array.__array_interface__["data"][0] if array.flags.c_contiguous else None
        index = self.leaf(array, array.nbytes, address)
        return msgpack.ExtType(EXT_NDARRAY, pack([dtype.str, list(array.shape), index]))


def _find_unsupported(obj: Any, path: str, in_set: bool = False, in_key: bool = False) -> str | None:
    """Slow path for the error message: where in the tree is the value we cannot carry?"""
    if isinstance(obj, dict):
        pairs = (((f"{path} (key {k!r})", k, True), (f"{path}[{k!r}]", v, in_key)) for k, v in obj.items())
        children = (child for pair in pairs for child in pair)
    elif isinstance(obj, (list, tuple)):
        children = ((f"{path}[{i}]", v, in_key) for i, v in enumerate(obj))
    elif isinstance(obj, (set, frozenset)):
        children = ((f"{path} (member {v!r})", v, in_key) for v in obj)
        in_set = True
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type) and not (in_set or in_key):
        children = ((f"{path}.{f.name}", getattr(obj, f.name), in_key) for f in dataclasses.fields(obj))
    else:
        walker = _Walker()
        walker.in_set, walker.in_key = int(in_set), int(in_key)
        try:
            pack(walker.convert(obj))
        except (UnsupportedTypeError, UnicodeEncodeError):
            return path
        return None
    for child_path, child, child_in_key in children:
        found = _find_unsupported(child, child_path, in_set, child_in_key)
        if found:
            return found
    return None


def encode(obj: Any) -> bytearray:
    """Encode `obj` into a standalone frame (one copy of each buffer)."""
    frame_plan = plan(obj)
    out = bytearray(frame_plan.nbytes)
    frame_plan.write_into(out)
    return out

