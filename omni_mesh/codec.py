"""Zero-copy framing of stage artifacts.

A frame is laid out so that it can be written straight into shared memory and read back as views:

    prefix   24 bytes  magic b"OMF1", version u16, flags u16, buffer count u32, header length u32,
                       frame length u64 (all little-endian)
    lengths  8 bytes per out-of-band buffer (u64)
    header   msgpack: the object tree; tensors, arrays and large bytes are ext references to buffers
    buffers  each starts at a 64-byte aligned offset from the frame start, in order; a buffer that no
             leaf references is padding (the encoder uses it to place a large leaf at the page
             offset where memcpy from its source runs fastest)

Buffer offsets are not stored: both sides derive them from the lengths, so the header can be built
before its own size is known. Decoding never trusts the frame: every length, shape, dtype and offset
is checked against the bytes actually present, and nothing larger than the frame is ever allocated.
There is no pickle anywhere; only the types listed in `encode` round-trip.
"""

from __future__ import annotations

import ctypes
import math
import re
import struct
from typing import Any

import msgpack
import numpy as np
import torch

MAGIC = b"OMF1"
VERSION = 1
ALIGN = 64
PAGE = 4096
PAGE_MATCH_MIN = 64 * 1024  # leaves this large get a padding buffer choosing their page offset
PREFIX = struct.Struct("<4sHHIIQ")
MAX_NDIM = 64
MAX_TUPLE_DEPTH = 64
INLINE_BYTES_MAX = 511  # bytes up to this size stay in the header; larger ones go out of band

EXT_TENSOR = 1
EXT_NDARRAY = 2
EXT_BYTES = 3
EXT_TUPLE = 4
EXT_NPSCALAR = 5

_NUMPY_KINDS = frozenset("biufcmMSU")


class FrameError(ValueError):
    """A frame is malformed, truncated or hostile."""


class UnsupportedTypeError(TypeError):
    """The payload holds a value the codec does not carry (it never falls back to pickle)."""


_NOT_CARRIED = re.compile(r"q\w+|bits\w+|u?int[1-7]")


def _torch_dtypes() -> dict[str, torch.dtype]:
    table = {}
    for name in dir(torch):
        value = getattr(torch, name)
        if not isinstance(value, torch.dtype):
            continue
        canonical = str(value).removeprefix("torch.")
        if _NOT_CARRIED.fullmatch(canonical):
            continue  # quantized and sub-byte dtypes have no plain element layout to carry
        table[canonical] = value
    return table


TORCH_DTYPES: dict[str, torch.dtype] = _torch_dtypes()
_DTYPE_NAMES: dict[torch.dtype, str] = {dtype: name for name, dtype in TORCH_DTYPES.items()}


def _tuple_budget(header_len: int) -> int:
    """Bytes of tuple bodies a frame may carry in all. Each tuple level hands its body on as a new bytes
    object, so without a bound nested tuples would make decoding allocate depth x the frame size."""
    return 4 * header_len + 65536


def align(n: int) -> int:
    return (n + ALIGN - 1) & ~(ALIGN - 1)


def _buffer_offsets(start: int, lengths: list[int]) -> list[int]:
    offsets = []
    pos = align(start)
    for length in lengths:
        offsets.append(pos)
        pos = align(pos + length)
    return offsets


# --------------------------------------------------------------------------- encoding


class _PagePad:
    """An unreferenced buffer placed before a large leaf to choose the leaf's page offset.

    memcpy speed depends on where the destination sits relative to the source modulo 4096: equal
    offsets hit 4K aliasing in the vector loop (slow at mid sizes), and a destination slightly ahead
    of the source makes glibc's non-temporal path fall back (about 4x slower at 256 MiB). Measured on
    this project's machines, a destination 64 bytes behind the source is fast at every size.
    Decoders need nothing: a buffer no leaf references is legal and ignored.
    """

    __slots__ = ("page_offset",)

    def __init__(self, address: int) -> None:
        self.page_offset = (address - ALIGN) % PAGE & ~(ALIGN - 1)


class FramePlan:
    """An object tree planned into a frame: its size is known before any byte is written.

    Offsets assume the frame starts on a page boundary; destinations that cannot promise that still
    get a valid frame, only without the page-offset matching of large leaves.
    """

    __slots__ = ("header", "leaves", "lengths", "offsets", "nbytes")

    def __init__(self, header: bytes, leaves: list[Any], lengths: list[int]) -> None:
        self.header = header
        self.leaves = leaves
        self.lengths = lengths
        self.offsets = []
        pos = PREFIX.size + 8 * len(lengths) + len(header)
        for i, leaf in enumerate(leaves):
            start = align(pos)
            if type(leaf) is _PagePad:
                lengths[i] = (leaf.page_offset - start) % PAGE
            self.offsets.append(start)
            pos = start + lengths[i]
        self.nbytes = pos

    @property
    def payload_bytes(self) -> int:
        return sum(self.lengths)

    def write_into(self, dest: Any, offset: int = 0) -> int:
        """Lay the whole frame into `dest` (any writable buffer) at `offset`; returns its size."""
        with memoryview(dest) as whole:
            if whole.readonly or whole.nbytes < offset + self.nbytes:
                raise ValueError(
                    f"destination holds {whole.nbytes - offset} writable bytes, frame needs {self.nbytes}"
                )
            view = whole.cast("B")[offset : offset + self.nbytes]
            count = len(self.lengths)
            PREFIX.pack_into(view, 0, MAGIC, VERSION, 0, count, len(self.header), self.nbytes)
            pos = PREFIX.size
            if count:
                struct.pack_into(f"<{count}Q", view, pos, *self.lengths)
                pos += 8 * count
            view[pos : pos + len(self.header)] = self.header
            if count:
                address = ctypes.addressof(ctypes.c_char.from_buffer(view))
                for leaf, off, length in zip(self.leaves, self.offsets, self.lengths, strict=True):
                    if length and type(leaf) is not _PagePad:
                        _copy_leaf(leaf, view, address, off, length)
            view.release()
        return self.nbytes


def _copy_leaf(leaf: Any, view: memoryview, address: int, offset: int, length: int) -> None:
    # ctypes.memmove releases the GIL and runs at memcpy speed; strided sources go through torch/numpy.
    if isinstance(leaf, torch.Tensor):
        if leaf.is_contiguous():
            ctypes.memmove(address + offset, leaf.data_ptr(), length)
        else:
            dest = torch.frombuffer(view, dtype=leaf.dtype, count=leaf.numel(), offset=offset)
            dest.view(leaf.shape).copy_(leaf)
    elif isinstance(leaf, np.ndarray):
        if leaf.flags.c_contiguous:
            ctypes.memmove(address + offset, leaf.__array_interface__["data"][0], length)
        else:
            dest = np.frombuffer(view, dtype=leaf.dtype, count=leaf.size, offset=offset)
            np.copyto(dest.reshape(leaf.shape), leaf)
    else:
        view[offset : offset + length] = leaf


def plan(obj: Any) -> FramePlan:
    """Plan `obj` into a frame. Raises UnsupportedTypeError naming the value it cannot carry and where."""
    walker = _Walker()
    try:
        header = _pack(walker.convert(obj))
    except (UnsupportedTypeError, UnicodeEncodeError) as exc:
        message = str(exc) if isinstance(exc, UnsupportedTypeError) else _not_utf8(exc)
        try:
            where = _find_unsupported(obj, "payload")
        except RecursionError:
            where = None
        raise UnsupportedTypeError(f"{message} at {where}" if where else message) from None
    except RecursionError:
        raise UnsupportedTypeError("payload nests too deeply to encode") from None
    if walker.tuple_bytes > _tuple_budget(len(header)):
        raise UnsupportedTypeError(
            f"tuples nested in tuples hold {walker.tuple_bytes} bytes for a {len(header)}-byte header, more "
            f"than decoders accept ({_tuple_budget(len(header))}); nest lists instead"
        )
    return FramePlan(header, walker.leaves, walker.lengths)


def _not_utf8(exc: UnicodeEncodeError) -> str:
    return f"cannot encode a str that is not valid UTF-8 ({exc.reason})"


def _pack(value: Any) -> bytes:
    # strict_types keeps tuples (already turned into ext) from being packed as lists by mistake.
    return msgpack.packb(value, strict_types=True, use_bin_type=True, datetime=False)


_NATIVE = (str, float, bool, type(None))


class _Walker:
    """Turns an object tree into a msgpack-native tree, moving large leaves out of band."""

    def __init__(self) -> None:
        self.leaves: list[Any] = []
        self.lengths: list[int] = []
        self.depth = 0  # of tuples, as the decoder counts them
        self.tuple_bytes = 0

    def leaf(self, leaf: Any, nbytes: int, address: int | None = None) -> int:
        if address is not None and nbytes >= PAGE_MATCH_MIN:
            self.leaves.append(_PagePad(address))
            self.lengths.append(0)  # sized when the frame is laid out
        self.leaves.append(leaf)
        self.lengths.append(nbytes)
        return len(self.leaves) - 1

    def convert(self, value: Any) -> Any:
        kind = type(value)
        if kind in _NATIVE:
            return value
        if kind is int:
            if not -(2**63) <= value < 2**64:
                raise UnsupportedTypeError(f"cannot encode the integer {value}: it does not fit in 64 bits")
            return value
        if kind is dict:
            return {self.convert(k): self.convert(v) for k, v in value.items()}
        if kind is list:
            return [self.convert(v) for v in value]
        if kind is tuple:
            self.depth += 1
            if self.depth > MAX_TUPLE_DEPTH:
                raise UnsupportedTypeError(f"tuples nest deeper than {MAX_TUPLE_DEPTH}")
            body = _pack([self.convert(v) for v in value])
            self.depth -= 1
            self.tuple_bytes += len(body)
            return msgpack.ExtType(EXT_TUPLE, body)
        if kind is bytes:
            if len(value) <= INLINE_BYTES_MAX:
                return value
            return msgpack.ExtType(EXT_BYTES, _pack(self.leaf(value, len(value))))
        if isinstance(value, torch.Tensor):
            return self.tensor(value)
        if isinstance(value, np.ndarray):
            return self.ndarray(value)
        if isinstance(value, np.generic) and value.dtype.kind in _NUMPY_KINDS:
            dtype, raw = value.dtype, value.tobytes()
            if not dtype.itemsize:  # np.str_("") or np.bytes_(b""): one NUL element, which numpy strips
                dtype, raw = np.dtype(dtype.kind + "1"), bytes(np.dtype(dtype.kind + "1").itemsize)
            return msgpack.ExtType(EXT_NPSCALAR, _pack([dtype.str, raw]))
        # Subclasses (OrderedDict, IntEnum, str enums, namedtuples, torch.Size) travel as their base.
        for base in (bool, int, float, str, bytes, dict, list, tuple):
            if isinstance(value, base):
                # str() of a str-mixin enum member is "Cls.NAME", not its value: take the str itself.
                return self.convert(str.__str__(value) if base is str else base(value))
        if isinstance(value, (bytearray, memoryview)):
            return self.convert(bytes(value))
        raise UnsupportedTypeError(f"cannot encode a value of type {kind.__qualname__}")

    def tensor(self, tensor: torch.Tensor) -> msgpack.ExtType:
        name = _DTYPE_NAMES.get(tensor.dtype)
        if name is None:
            raise UnsupportedTypeError(f"cannot encode a tensor of dtype {tensor.dtype}; convert it first")
        if tensor.layout is not torch.strided or tensor.is_nested:
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
        return msgpack.ExtType(EXT_TENSOR, _pack([name, list(tensor.shape), index]))

    def ndarray(self, array: np.ndarray) -> msgpack.ExtType:
        dtype = array.dtype
        if dtype.kind not in _NUMPY_KINDS or dtype.hasobject or dtype.fields or dtype.subdtype:
            raise UnsupportedTypeError(f"cannot encode a numpy array of dtype {dtype}")
        address = array.__array_interface__["data"][0] if array.flags.c_contiguous else None
        index = self.leaf(array, array.nbytes, address)
        return msgpack.ExtType(EXT_NDARRAY, _pack([dtype.str, list(array.shape), index]))


def _find_unsupported(obj: Any, path: str) -> str | None:
    """Slow path for the error message: where in the tree is the value we cannot carry?"""
    if isinstance(obj, dict):
        pairs = (((f"{path} (key {k!r})", k), (f"{path}[{k!r}]", v)) for k, v in obj.items())
        children = (child for pair in pairs for child in pair)
    elif isinstance(obj, (list, tuple)):
        children = ((f"{path}[{i}]", v) for i, v in enumerate(obj))
    else:
        try:
            _pack(_Walker().convert(obj))
        except (UnsupportedTypeError, UnicodeEncodeError):
            return path
        return None
    for child_path, child in children:
        found = _find_unsupported(child, child_path)
        if found:
            return found
    return None


def encode(obj: Any) -> bytearray:
    """Encode `obj` into a standalone frame (one copy of each buffer)."""
    frame_plan = plan(obj)
    out = bytearray(frame_plan.nbytes)
    frame_plan.write_into(out)
    return out


# --------------------------------------------------------------------------- decoding


def frame_length(buffer: Any, offset: int = 0) -> int:
    """Read the frame length from a frame's prefix, checking the magic."""
    view = memoryview(buffer)
    if len(view) - offset < PREFIX.size:
        raise FrameError(f"truncated frame: {len(view) - offset} bytes, the prefix alone is {PREFIX.size}")
    magic, version, _flags, _count, _hlen, nbytes = PREFIX.unpack_from(view, offset)
    if magic != MAGIC or version != VERSION:
        raise FrameError(f"not an omni-mesh frame (magic {bytes(magic)!r}, version {version})")
    return nbytes


def decode(buffer: Any, offset: int = 0, *, copy: bool = False) -> Any:
    """Decode the frame at `offset` of `buffer`.

    With copy=False, tensors and arrays are views over `buffer` (which they keep alive); a read-only
    buffer is copied once first so the views are writable. With copy=True every tensor and array is
    copied exactly once and `buffer` may be released as soon as this returns.
    """
    try:
        return _decode(buffer, offset, copy)
    except FrameError:
        raise
    except RecursionError:
        raise FrameError("frame nests too deeply") from None
    except Exception as exc:  # any malformed input must surface as one clear error type
        raise FrameError(f"malformed frame: {type(exc).__name__}: {exc}") from None


def _decode(buffer: Any, offset: int, copy: bool) -> Any:
    whole = np.frombuffer(buffer, dtype=np.uint8)
    available = whole.size - offset
    if available < PREFIX.size:
        raise FrameError(f"truncated frame: {available} bytes, the prefix alone is {PREFIX.size}")
    magic, version, _flags, count, header_len, nbytes = PREFIX.unpack_from(whole, offset)
    if magic != MAGIC or version != VERSION:
        raise FrameError(f"not an omni-mesh frame (magic {bytes(magic)!r}, version {version})")
    if nbytes > available:
        raise FrameError(f"truncated frame: prefix says {nbytes} bytes, {available} present")
    table_end = PREFIX.size + 8 * count
    if table_end + header_len > nbytes:
        raise FrameError(f"truncated frame: {count} buffers and a {header_len}-byte header exceed {nbytes} bytes")
    if not copy and not whole.flags.writeable:
        whole, offset = whole[offset : offset + nbytes].copy(), 0  # views must be writable tensors
    lengths = list(struct.unpack_from(f"<{count}Q", whole, offset + PREFIX.size)) if count else []
    offsets = _buffer_offsets(table_end + header_len, lengths)
    if lengths and offsets[-1] + lengths[-1] > nbytes:
        raise FrameError(f"buffer table overruns the frame ({offsets[-1] + lengths[-1]} > {nbytes} bytes)")
    header_start = offset + table_end
    with memoryview(whole) as view:
        header = view[header_start : header_start + header_len]
        return _Reader(whole, offset, offsets, lengths, copy, _tuple_budget(header_len)).unpack(header)


class _Reader:
    def __init__(
        self, whole: np.ndarray, base: int, offsets: list[int], lengths: list[int], copy: bool, budget: int
    ) -> None:
        self.whole = whole
        self.base = base
        self.offsets = offsets
        self.lengths = lengths
        self.copy = copy
        self.depth = 0
        self.tuple_budget = budget  # bytes of tuple bodies still allowed (see _tuple_budget)

    def unpack(self, data: Any) -> Any:
        # Ext type -1 is msgpack's timestamp, which msgpack decodes itself without calling ext_hook:
        # as a float (timestamp=1) it cannot bring a type into the tree that encode does not carry.
        return msgpack.unpackb(
            data, ext_hook=self.ext, raw=False, strict_map_key=False, use_list=True, timestamp=1
        )

    def start(self, index: Any, expected: int) -> int:
        """Absolute offset in `whole` of buffer `index`, checked to hold exactly `expected` bytes."""
        if type(index) is not int or not 0 <= index < len(self.lengths):
            raise FrameError(f"buffer reference {index!r} out of range ({len(self.lengths)} buffers)")
        if self.lengths[index] != expected:
            raise FrameError(f"buffer {index} holds {self.lengths[index]} bytes, its leaf needs {expected}")
        return self.base + self.offsets[index]

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
            return self.tensor(*_fields(fields, 3, "tensor"))
        if code == EXT_NDARRAY:
            return self.ndarray(*_fields(fields, 3, "ndarray"))
        if code == EXT_BYTES:
            length = self.lengths[fields] if type(fields) is int and 0 <= fields < len(self.lengths) else -1
            start = self.start(fields, length)
            return self.whole[start : start + length].tobytes()
        if code == EXT_NPSCALAR:
            dtype_str, raw = _fields(fields, 2, "numpy scalar")
            dtype = _numpy_dtype(dtype_str)
            if not isinstance(raw, bytes) or len(raw) != dtype.itemsize:
                raise FrameError(f"numpy scalar of {dtype} needs {dtype.itemsize} bytes")
            return np.frombuffer(raw, dtype=dtype)[0]
        raise FrameError(f"unknown extension type {code}")

    def tensor(self, name: Any, shape: Any, index: Any) -> torch.Tensor:
        dtype = TORCH_DTYPES.get(name) if type(name) is str else None
        if dtype is None:
            raise FrameError(f"unknown tensor dtype {name!r}")
        shape = _shape(shape)
        numel = math.prod(shape)
        start = self.start(index, numel * dtype.itemsize)
        if numel == 0:
            return torch.empty(shape, dtype=dtype)
        tensor = torch.frombuffer(self.whole, dtype=dtype, count=numel, offset=start)
        if len(shape) != 1:
            tensor = tensor.view(shape)
        return tensor.clone() if self.copy else tensor

    def ndarray(self, dtype_str: Any, shape: Any, index: Any) -> np.ndarray:
        dtype = _numpy_dtype(dtype_str)
        shape = _shape(shape)
        numel = math.prod(shape)
        start = self.start(index, numel * dtype.itemsize)
        if numel == 0:
            return np.empty(shape, dtype=dtype)
        array = np.frombuffer(self.whole, dtype=dtype, count=numel, offset=start).reshape(shape)
        return array.copy() if self.copy else array


def _fields(fields: Any, count: int, what: str) -> list[Any]:
    if not isinstance(fields, list) or len(fields) != count:
        raise FrameError(f"{what} extension needs {count} fields")
    return fields


def _shape(shape: Any) -> tuple[int, ...]:
    if type(shape) is not list or len(shape) > MAX_NDIM:
        raise FrameError(f"bad shape {shape!r}")
    for dim in shape:
        if type(dim) is not int or not 0 <= dim < 2**62:
            raise FrameError(f"bad shape {shape!r}")
    return tuple(shape)


def _numpy_dtype(text: Any) -> np.dtype:
    if not isinstance(text, str) or len(text) > 16:
        raise FrameError(f"bad numpy dtype {text!r}")
    try:
        dtype = np.dtype(text)
    except TypeError:
        raise FrameError(f"bad numpy dtype {text!r}") from None
    if dtype.kind not in _NUMPY_KINDS or dtype.hasobject or dtype.fields or dtype.subdtype or dtype.itemsize == 0:
        raise FrameError(f"numpy dtype {text!r} is not allowed")
    return dtype
