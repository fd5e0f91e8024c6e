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
import functools
import math
import re
import struct
import threading
from collections.abc import Collection, Iterator
from typing import Any

import msgpack
import numpy as np
import torch

from omni_mesh import cuda_ipc

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
EXT_CUDA_IPC = 6  # a CUDA tensor by IPC handle (same host only; see omni_mesh.cuda_ipc)
EXT_DEVICE_TENSOR = 7  # a tensor whose bytes travel outside the frame, into a device buffer of the consumer

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

    __slots__ = ("header", "leaves", "lengths", "offsets", "nbytes", "head", "payload_bytes")

    def __init__(self, header: bytes, leaves: list[Any], lengths: list[int]) -> None:
        self.header = header
        self.leaves = leaves
        pads = tuple(leaf.page_offset for leaf in leaves if type(leaf) is _PagePad)
        key = (header, tuple(lengths), pads)
        layout = _LAYOUTS.get(key)
        if layout is None:
            layout = _layout(header, leaves, lengths)
            if len(_LAYOUTS) >= LAYOUT_CACHE_SIZE:
                _LAYOUTS.clear()
            _LAYOUTS[key] = layout
        self.lengths, self.offsets, self.nbytes, self.head, self.payload_bytes = layout

    def write_into(self, dest: Any, offset: int = 0) -> int:
        """Lay the whole frame into `dest` (any writable buffer) at `offset`; returns its size."""
        with memoryview(dest) as whole:
            if whole.readonly or whole.nbytes < offset + self.nbytes:
                raise ValueError(
                    f"destination holds {whole.nbytes - offset} writable bytes, frame needs {self.nbytes}"
                )
            flat = whole if whole.format == "B" and whole.ndim == 1 else whole.cast("B")
            with flat[offset : offset + self.nbytes] as view:
                # The export keeps the destination in place while write_at copies to its address.
                self.write_at(ctypes.addressof(ctypes.c_char.from_buffer(view)))
            if flat is not whole:
                flat.release()
        return self.nbytes

    def inline_parts(self) -> list[bytearray]:
        """Each leaf as its own buffer (padding as empty ones): the parts form, for tiny payloads."""
        lengths = [0 if type(leaf) is _PagePad else n for leaf, n in zip(self.leaves, self.lengths, strict=True)]
        return leaf_buffers(self.leaves, lengths)

    def write_at(self, address: int) -> int:
        """Lay the frame at a raw `address` the caller guarantees holds `nbytes` mapped, writable bytes.

        The hot path of the shared-memory pool: no buffer exports, only memmoves. Strided leaves
        still go through torch/numpy, over a ctypes array at the address.
        """
        ctypes.memmove(address, self.head, len(self.head))
        for leaf, off, length in zip(self.leaves, self.offsets, self.lengths, strict=True):
            if not length or type(leaf) is _PagePad:
                continue
            if type(leaf) is torch.Tensor and leaf.is_contiguous():
                ctypes.memmove(address + off, leaf.data_ptr(), length)  # the common case, without dispatch
            else:
                view = memoryview((ctypes.c_char * length).from_address(address + off)).cast("B")
                _copy_leaf(leaf, view, address + off, 0, length)
                view.release()
        return self.nbytes


def sparse_layout(frame: FramePlan, skip: Collection[int]) -> tuple[list[tuple[int, int, int]], int]:
    """The frame packed without the leaves numbered in `skip` and without its padding, for a sender
    that sends those leaves from their own memory beside the packed rest.

    Returns the runs of bytes that remain as (frame start, frame end, offset in the packed region), in
    frame order, and the packed size. Each run keeps its frame offset modulo ALIGN, so leaves in it
    stay aligned; the first run starts at 0 and holds the head.
    """
    gaps = [
        (offset, offset + length)
        for i, (leaf, offset, length) in enumerate(zip(frame.leaves, frame.offsets, frame.lengths, strict=True))
        if length and (i in skip or type(leaf) is _PagePad)
    ]
    runs: list[tuple[int, int, int]] = []
    pos = start = 0
    for gap_start, gap_end in [*gaps, (frame.nbytes, frame.nbytes)]:
        if gap_start > start:
            at = align(pos) + start % ALIGN
            runs.append((start, gap_start, at))
            pos = at + gap_start - start
        start = gap_end
    return runs, pos


def write_sparse(frame: FramePlan, skip: Collection[int], runs: list[tuple[int, int, int]], address: int) -> None:
    """Lay the bytes of `runs` (from `sparse_layout(frame, skip)`) at `address`, which the caller
    guarantees holds the packed size in mapped, writable bytes."""
    size = runs[-1][2] + runs[-1][1] - runs[-1][0]
    ctypes.memmove(address, frame.head, len(frame.head))
    view = memoryview((ctypes.c_char * size).from_address(address)).cast("B")
    try:
        run = 0
        for i, (leaf, offset, length) in enumerate(zip(frame.leaves, frame.offsets, frame.lengths, strict=True)):
            if not length or i in skip or type(leaf) is _PagePad:
                continue
            while runs[run][1] <= offset:
                run += 1
            start, _, at = runs[run]
            _copy_leaf(leaf, view, address, at + offset - start, length)
    finally:
        view.release()


# Layouts by (header, leaf lengths, pad page offsets): payloads repeat their structure, so a frame's
# offsets and its packed prefix, table and header are computed once.
LAYOUT_CACHE_SIZE = 512
_LAYOUTS: dict[tuple, tuple[list[int], list[int], int, bytes, int]] = {}


def _layout(header: bytes, leaves: list[Any], lengths: list[int]) -> tuple[list[int], list[int], int, bytes, int]:
    """(lengths with pads sized, buffer offsets, frame size, prefix + table + header, payload bytes) of a
    frame; payload bytes count the header and the leaves, not the frame's prefix, table and padding."""
    payload_bytes = len(header) + sum(lengths)  # pads are still 0 here
    lengths = list(lengths)
    offsets = []
    count = len(lengths)
    pos = PREFIX.size + 8 * count + len(header)
    for i, leaf in enumerate(leaves):
        start = align(pos)
        if type(leaf) is _PagePad:
            lengths[i] = (leaf.page_offset - start) % PAGE
        offsets.append(start)
        pos = start + lengths[i]
    # Prefix, buffer table and header in one piece: written with a single copy.
    table = struct.pack(f"<{count}Q", *lengths) if count else b""
    head = PREFIX.pack(MAGIC, VERSION, 0, count, len(header), pos) + table + header
    return lengths, offsets, pos, head, payload_bytes


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


class CudaIpcExports:
    """Device policy of `split`: CUDA tensors travel by CUDA IPC handle (a consumer on the same host
    maps them on the device). The caller keeps `exports` until the payload is consumed or freed."""

    def __init__(self) -> None:
        self.exports: list[cuda_ipc.Exported] = []

    def wants(self, tensor: torch.Tensor) -> bool:
        return tensor.is_cuda

    def entry(self, name: str, tensor: torch.Tensor) -> msgpack.ExtType:
        exported = cuda_ipc.export(tensor)
        self.exports.append(exported)
        return msgpack.ExtType(EXT_CUDA_IPC, _pack([name, *exported.fields]))


class DeviceLeaves:
    """Device policy of `split`: CUDA tensors stay out of the frame, as contiguous `tensors` a transport
    moves device to device itself; the consumer decodes them from the `device_buffers` it received.

    `host_min_bytes` > 0 sends CPU tensors that large the same way (receive buffers then live in host
    memory): how the protocol is tested on machines without a GPU.
    """

    def __init__(self, host_min_bytes: int = 0) -> None:
        self.tensors: list[torch.Tensor] = []
        self.host_min_bytes = host_min_bytes

    def wants(self, tensor: torch.Tensor) -> bool:
        return tensor.is_cuda or (0 < self.host_min_bytes <= tensor.nbytes and tensor.is_cpu)

    def entry(self, name: str, tensor: torch.Tensor) -> msgpack.ExtType:
        self.tensors.append(tensor.contiguous())
        return msgpack.ExtType(EXT_DEVICE_TENSOR, _pack([name, list(tensor.shape), len(self.tensors) - 1]))


def split(obj: Any, *, device: CudaIpcExports | DeviceLeaves | None = None) -> tuple[bytes, list[Any], list[int]]:
    """The msgpack header of `obj` and its out-of-band leaves (with their sizes), before any layout.

    CUDA tensors are copied to host memory, unless a `device` policy takes them (CudaIpcExports,
    DeviceLeaves). Raises UnsupportedTypeError naming the value it cannot carry and where.
    """
    walker = _Walker(device)
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
_FLAT_PLANS: dict[tuple, tuple[FramePlan, tuple[_PagePad | None, ...]]] = {}


def _flat_plan(obj: dict) -> FramePlan | None:
    """The plan of a dict of contiguous CPU tensors with str keys, from the cache; None for anything else."""
    signature: list[Any] = []
    tensors = []
    for key, value in obj.items():
        if (
            type(key) is not str
            or type(value) is not torch.Tensor
            or not (value.is_cpu and value.layout is torch.strided and value.is_contiguous())
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
        if any(_DTYPE_NAMES.get(t.dtype) is None for t in tensors):
            return None  # the general path names the dtype it cannot carry
        model = FramePlan(*split(obj))
        pads = tuple(leaf if type(leaf) is _PagePad else None for leaf in model.leaves)
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


def leaf_buffers(leaves: list[Any], lengths: list[int]) -> list[bytearray]:
    """Each leaf of `split` as its own buffer: the parts form of a payload, for tiny ones sent inline."""
    parts = []
    for leaf, length in zip(leaves, lengths, strict=True):
        part = bytearray(length)
        if length and type(leaf) is not _PagePad:
            address = ctypes.addressof(ctypes.c_char.from_buffer(part))
            if type(leaf) is torch.Tensor and leaf.is_contiguous():
                ctypes.memmove(address, leaf.data_ptr(), length)  # the common case, without dispatch
            else:
                _copy_leaf(leaf, memoryview(part), address, 0, length)
        parts.append(part)
    return parts


@functools.lru_cache(maxsize=1024)
def _tensor_ext(name: str, shape: torch.Size, index: int) -> msgpack.ExtType:
    """The header entry of a tensor leaf; payloads repeat their shapes, so it is packed once."""
    return msgpack.ExtType(EXT_TENSOR, _pack([name, list(shape), index]))


def _not_utf8(exc: UnicodeEncodeError) -> str:
    return f"cannot encode a str that is not valid UTF-8 ({exc.reason})"


_PACKERS = threading.local()


def _pack(value: Any) -> bytes:
    # One packer per thread: building one per call costs more than packing a small header.
    try:
        packer = _PACKERS.packer
    except AttributeError:
        # strict_types keeps tuples (already turned into ext) from being packed as lists by mistake.
        packer = _PACKERS.packer = msgpack.Packer(strict_types=True, use_bin_type=True, datetime=False)
    return packer.pack(value)


_NATIVE = (str, float, bool, type(None))


class _Walker:
    """Turns an object tree into a msgpack-native tree, moving large leaves out of band."""

    def __init__(self, device: CudaIpcExports | DeviceLeaves | None = None) -> None:
        self.device = device
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
        if kind is torch.Tensor:  # the usual leaf, ahead of the container checks
            return self.tensor(value)
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
        if self.device is not None and name is not None and self.device.wants(tensor):
            return self.device_entry(name, tensor)
        if (
            name is not None
            and tensor.is_cpu
            and tensor.layout is torch.strided
            and not (tensor.is_nested or tensor.is_conj() or tensor.is_neg())
            and tensor.is_contiguous()
        ):  # the common case, checked in one go: the leaf is copied from data_ptr as it stands
            index = self.leaf(tensor, tensor.nbytes, tensor.data_ptr())
            return _tensor_ext(name, tensor.shape, index)
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
        return _tensor_ext(name, tensor.shape, index)

    def device_entry(self, name: str, tensor: torch.Tensor) -> msgpack.ExtType:
        if tensor.layout is not torch.strided or tensor.is_nested:
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


def decode(
    buffer: Any,
    offset: int = 0,
    *,
    copy: bool = False,
    device_buffers: list[torch.Tensor] | None = None,
    cuda_local: list[torch.Tensor] | None = None,
) -> Any:
    """Decode the frame at `offset` of `buffer`.

    With copy=False, tensors and arrays are views over `buffer` (which they keep alive); a read-only
    buffer is copied once first so the views are writable. With copy=True every tensor and array is
    copied exactly once and `buffer` may be released as soon as this returns. `device_buffers` are the
    received bytes of the frame's device tensors (DeviceLeaves), one flat uint8 tensor each, in order.
    `cuda_local` are the tensors of the frame's CUDA IPC entries when this process exported them itself
    (CUDA cannot map a process's own handle), in order.
    """
    try:
        return _decode(buffer, offset, copy, device_buffers, cuda_local)
    except Exception as exc:
        raise _frame_error(exc) from None


def _frame_error(exc: Exception) -> Exception:
    """Any malformed input surfaces as one clear error type, FrameError (a CUDA tensor this process
    cannot map is not a malformed frame: it keeps its own type)."""
    if isinstance(exc, (FrameError, cuda_ipc.CudaIpcUnavailable)):
        return exc
    if isinstance(exc, RecursionError):
        return FrameError("frame nests too deeply")
    return FrameError(f"malformed frame: {type(exc).__name__}: {exc}")


def _decode(
    buffer: Any,
    offset: int,
    copy: bool,
    device_buffers: list[torch.Tensor] | None = None,
    cuda_local: list[torch.Tensor] | None = None,
) -> Any:
    with memoryview(buffer) as view:
        available = view.nbytes - offset
        readonly = view.readonly
        if offset < 0 or available < PREFIX.size:
            raise FrameError(f"truncated frame: {available} bytes, the prefix alone is {PREFIX.size}")
        magic, version, _flags, count, header_len, nbytes = PREFIX.unpack_from(view, offset)
        if magic != MAGIC or version != VERSION:
            raise FrameError(f"not an omni-mesh frame (magic {bytes(magic)!r}, version {version})")
        if nbytes > available:
            raise FrameError(f"truncated frame: prefix says {nbytes} bytes, {available} present")
        head_end = PREFIX.size + 8 * count + header_len
        if head_end > nbytes:
            raise FrameError(
                f"truncated frame: {count} buffers and a {header_len}-byte header exceed {nbytes} bytes"
            )
        head = view[offset : offset + head_end].tobytes()
    layout = _HEADS.get(head)
    if layout is None:
        layout = _read_head(head, count, header_len, nbytes)
    template, offsets, lengths, flat = layout
    if readonly and not copy:  # views must be writable tensors: copy the frame once
        buffer, offset = bytearray(memoryview(buffer)[offset : offset + nbytes]), 0
    if flat is not None and not copy:  # (flat frames have no device entries)
        # A dict of tensors, already checked against this very head: views straight off the buffer.
        out = {}
        for key, dtype, count, at, shape in flat:
            if count:
                tensor = torch.frombuffer(buffer, dtype=dtype, count=count, offset=offset + at)
                out[key] = tensor if shape is None else tensor.view(shape)  # view() costs as much again
            else:
                out[key] = torch.empty(shape or (0,), dtype=dtype)
        return out
    buffers = _Buffers(buffer, offset, offsets, lengths, copy)
    buffers.device = device_buffers
    buffers.cuda_local = None if cuda_local is None else iter(cuda_local)
    return template.build(buffers)


# Decoding layouts by frame head (prefix, buffer table and header), for the same reason as _LAYOUTS.
HEAD_CACHE_MAX = 8192  # larger heads are read each time, not kept
_HEADS: dict[bytes, tuple[Any, list[int], list[int], tuple | None]] = {}


def _read_head(
    head: bytes, count: int, header_len: int, nbytes: int
) -> tuple[Any, list[int], list[int], tuple | None]:
    """(template, buffer offsets, buffer lengths, flat) of a frame head, validated against the frame
    size; `flat` is set for a dict of tensors whose buffers all check out (see _flat_tensors)."""
    table_end = PREFIX.size + 8 * count
    lengths = list(_table(count).unpack_from(head, PREFIX.size)) if count else []
    offsets = _buffer_offsets(table_end + header_len, lengths)
    if lengths and offsets[-1] + lengths[-1] > nbytes:
        raise FrameError(f"buffer table overruns the frame ({offsets[-1] + lengths[-1]} > {nbytes} bytes)")
    template, cacheable = _template(head[table_end:], header_len)
    layout = (template, offsets, lengths, _flat_tensors(template, offsets, lengths))
    if cacheable and len(head) <= HEAD_CACHE_MAX:
        if len(_HEADS) >= TEMPLATE_CACHE_SIZE:
            _HEADS.clear()  # hostile variety only costs re-reading, never memory
        _HEADS[head] = layout
    return layout


def _flat_tensors(template: Any, offsets: list[int], lengths: list[int]) -> tuple | None:
    """For a dict whose values are all tensors: (key, dtype, element count, buffer offset, shape or None
    for 1-D) per item, with every buffer already checked to hold exactly its tensor; else None."""
    if type(template) is not _DictNode:
        return None
    flat = []
    for key, slot in template.items:
        if type(slot) is not _TensorSlot or slot.index >= len(lengths) or lengths[slot.index] != slot.nbytes:
            return None  # the general path decodes it, or raises the precise error
        shape = None if len(slot.shape) == 1 else slot.shape  # 1-D: frombuffer's result as it is
        flat.append((key, slot.dtype, slot.numel, offsets[slot.index], shape))
    return tuple(flat)


def decode_parts(header: bytes, parts: list[Any], *, copy: bool = False) -> Any:
    """Decode the parts form (`split` + `leaf_buffers`): a header and one buffer per leaf."""
    try:
        if type(header) is not bytes or type(parts) is not list:
            raise FrameError("parts form needs a bytes header and a list of buffers")
        return _template(header, len(header))[0].build(_Parts(parts, copy))
    except Exception as exc:
        raise _frame_error(exc) from None


def _template(header: bytes, header_len: int) -> tuple[Any, bool]:
    """The compiled header, and whether it may be cached (CUDA IPC handles are unique to one put)."""
    template = _TEMPLATES.get(header)
    if template is not None:
        return template, True
    compiler = _Compiler(_tuple_budget(header_len))
    template = compiler.compile(header)
    if compiler.cuda_slots:
        return template, False
    if header_len <= TEMPLATE_HEADER_MAX:
        if len(_TEMPLATES) >= TEMPLATE_CACHE_SIZE:
            _TEMPLATES.clear()  # hostile variety only costs recompiling, never memory
        _TEMPLATES[header] = template
    return template, True


# --------------------------------------------------------------------------- decode templates
#
# A header is compiled once into a template: a tree of nodes whose leaves are slots (a tensor of this
# dtype and shape in buffer i) and constants. Everything the header alone decides is validated then;
# each decode only checks the buffer table against the slots and builds fresh containers and views.
# Stage payloads repeat their structure request after request, so the cache turns decoding into a
# dict lookup plus one view per leaf.

TEMPLATE_CACHE_SIZE = 512
TEMPLATE_HEADER_MAX = 4096  # larger headers (long lists of numbers) are compiled each time, not kept
_TEMPLATES: dict[bytes, Any] = {}
_CONSTANT = (str, int, float, bool, type(None), bytes, np.generic)


class _Buffers:
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


class _Parts:
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


class _Const:
    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value

    def build(self, buffers: _Buffers) -> Any:
        return self.value


class _FlatList(_Const):
    def build(self, buffers: _Buffers) -> Any:
        return list(self.value)  # a fresh list: callers may mutate what they get


class _FlatDict(_Const):
    def build(self, buffers: _Buffers) -> Any:
        return dict(self.value)


class _ListNode:
    __slots__ = ("children",)

    def __init__(self, children: list) -> None:
        self.children = children

    def build(self, buffers: _Buffers) -> Any:
        return [child.build(buffers) for child in self.children]


class _TupleNode(_ListNode):
    def build(self, buffers: _Buffers) -> Any:
        return tuple([child.build(buffers) for child in self.children])


class _DictNode:
    __slots__ = ("items",)

    def __init__(self, items: list) -> None:
        self.items = items

    def build(self, buffers: _Buffers) -> Any:
        return {key: child.build(buffers) for key, child in self.items}


class _TensorSlot:
    __slots__ = ("dtype", "shape", "numel", "nbytes", "index")

    def __init__(self, name: Any, shape: Any, index: Any) -> None:
        self.dtype = dtype = _torch_dtype(name)
        self.shape = _shape(shape)
        self.numel = math.prod(self.shape)
        self.nbytes = self.numel * dtype.itemsize
        self.index = _index(index)

    def build(self, buffers: _Buffers) -> torch.Tensor:
        whole, start = buffers.locate(self.index, self.nbytes)
        if self.numel == 0:
            return torch.empty(self.shape, dtype=self.dtype)
        tensor = torch.frombuffer(whole, dtype=self.dtype, count=self.numel, offset=start)
        if len(self.shape) != 1:
            tensor = tensor.view(self.shape)
        return tensor.clone() if buffers.copy else tensor


class _ArraySlot:
    __slots__ = ("dtype", "shape", "numel", "nbytes", "index")

    def __init__(self, dtype_str: Any, shape: Any, index: Any) -> None:
        self.dtype = _numpy_dtype(dtype_str)
        self.shape = _shape(shape)
        self.numel = math.prod(self.shape)
        self.nbytes = self.numel * self.dtype.itemsize
        self.index = _index(index)

    def build(self, buffers: _Buffers) -> np.ndarray:
        whole, start = buffers.locate(self.index, self.nbytes)
        if self.numel == 0:
            return np.empty(self.shape, dtype=self.dtype)
        array = np.frombuffer(whole, dtype=self.dtype, count=self.numel, offset=start).reshape(self.shape)
        return array.copy() if buffers.copy else array


class _BytesSlot:
    __slots__ = ("index",)

    def __init__(self, index: Any) -> None:
        self.index = _index(index)

    def build(self, buffers: _Buffers) -> bytes:
        length = buffers.length(self.index)
        whole, start = buffers.locate(self.index, length)
        with memoryview(whole) as view:
            return bytes(view.cast("B")[start : start + length])


class _CudaIpcSlot:
    """A CUDA tensor passed by IPC handle: every field is checked here, mapped only at build."""

    __slots__ = ("dtype", "fields")

    def __init__(self, fields: list[Any]) -> None:
        name, *ipc = _fields(fields, 1 + len(cuda_ipc.FIELDS), "CUDA IPC tensor")
        self.dtype = dtype = _torch_dtype(name)
        values = dict(zip(cuda_ipc.FIELDS, ipc, strict=True))
        shape, stride = _shape(values["shape"]), _shape(values["stride"])
        if len(stride) != len(shape):
            raise FrameError(f"CUDA IPC tensor: stride {stride} does not match shape {shape}")
        for field in ("storage_offset", "device", "storage_size_bytes", "storage_offset_bytes", "ref_counter_offset"):
            if type(values[field]) is not int or not 0 <= values[field] < 2**62:
                raise FrameError(f"CUDA IPC tensor: bad {field} {values[field]!r}")
        # torch shares an empty storage with no handle, no reference counter and no event (all None).
        empty = values["handle"] is None
        if empty and values["storage_size_bytes"]:
            raise FrameError("CUDA IPC tensor: a storage of bytes without a handle")
        for field in ("handle", "ref_counter_handle", "event_handle"):
            value = values[field]
            optional = empty or field == "event_handle"
            if not ((value is None and optional) or (type(value) is bytes and 0 < len(value) <= 256)):
                raise FrameError(f"CUDA IPC tensor: bad {field} {value!r}")
        if not (type(values["event_sync_required"]) is bool or (empty and values["event_sync_required"] is None)):
            raise FrameError("CUDA IPC tensor: bad event_sync_required")
        if all(shape):  # the view's last element must lie inside the shared storage
            end = (values["storage_offset"] + sum((n - 1) * s for n, s in zip(shape, stride, strict=True)) + 1)
            if end * dtype.itemsize > values["storage_size_bytes"]:
                raise FrameError(
                    f"CUDA IPC tensor of shape {list(shape)} reaches byte {end * dtype.itemsize} of a "
                    f"{values['storage_size_bytes']}-byte storage"
                )
        values["shape"], values["stride"] = shape, stride
        self.fields = values

    def build(self, buffers: _Buffers) -> torch.Tensor:
        local = getattr(buffers, "cuda_local", None)
        if local is not None:  # this process exported it: CUDA cannot map its own handle, take the tensor
            tensor = next(local)
            if tensor.dtype is not self.dtype or tuple(tensor.shape) != self.fields["shape"]:
                raise FrameError(f"CUDA IPC tensor of shape {list(self.fields['shape'])} does not match its export")
        else:
            tensor = cuda_ipc.open_tensor(self.dtype, self.fields)
        return tensor.clone() if buffers.copy else tensor  # the clone stays on the consumer's device


class _DeviceTensorSlot(_TensorSlot):
    """A tensor whose bytes arrived outside the frame, in a device buffer (see DeviceLeaves); `index`
    counts device buffers, not frame buffers."""

    __slots__ = ()

    def build(self, buffers: Any) -> torch.Tensor:
        received = getattr(buffers, "device", None) or []
        if self.index >= len(received):
            raise FrameError(f"device tensor {self.index} has no received buffer ({len(received)} given)")
        raw = received[self.index]
        if raw.dtype is not torch.uint8 or raw.dim() != 1 or raw.numel() != self.nbytes:
            raise FrameError(f"device buffer {self.index} holds {raw.numel()} bytes, its tensor needs {self.nbytes}")
        if not self.nbytes:
            return torch.empty(self.shape, dtype=self.dtype, device=raw.device)
        tensor = raw.view(self.dtype).view(self.shape)
        return tensor.clone() if buffers.copy else tensor


_SLOTS = (_TensorSlot, _ArraySlot, _BytesSlot, _CudaIpcSlot, _DeviceTensorSlot)


class _Compiler:
    """Turns a header into a template, validating everything the header alone decides."""

    def __init__(self, tuple_budget: int) -> None:
        self.cuda_slots = 0
        self.depth = 0
        self.tuple_budget = tuple_budget  # bytes of tuple bodies still allowed (see _tuple_budget)

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
            return _TensorSlot(*_fields(fields, 3, "tensor"))
        if code == EXT_NDARRAY:
            return _ArraySlot(*_fields(fields, 3, "ndarray"))
        if code == EXT_BYTES:
            return _BytesSlot(fields)
        if code == EXT_CUDA_IPC:
            self.cuda_slots += 1
            return _CudaIpcSlot(fields)
        if code == EXT_DEVICE_TENSOR:
            return _DeviceTensorSlot(*_fields(fields, 3, "device tensor"))
        if code == EXT_NPSCALAR:
            dtype_str, raw = _fields(fields, 2, "numpy scalar")
            dtype = _numpy_dtype(dtype_str)
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
            if all(type(child) is _Const for _, child in items):
                return _FlatDict(value)
            return _DictNode(items)
        if kind is list or kind is tuple:
            children = [self.node(child) for child in value]
            flat = all(type(child) is _Const for child in children)
            if kind is tuple:
                return _Const(value) if flat else _TupleNode(children)
            return _FlatList(value) if flat else _ListNode(children)
        if isinstance(value, _CONSTANT):
            return _Const(value)
        raise FrameError(f"unexpected {kind.__name__} in header")


@functools.lru_cache(maxsize=64)
def _table(count: int) -> struct.Struct:
    return struct.Struct(f"<{count}Q")


def _torch_dtype(name: Any) -> torch.dtype:
    dtype = TORCH_DTYPES.get(name) if type(name) is str else None
    if dtype is None:
        raise FrameError(f"unknown tensor dtype {name!r}")
    return dtype


def _index(index: Any) -> int:
    if type(index) is not int or index < 0:
        raise FrameError(f"buffer reference {index!r} is not a buffer index")
    return index


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
