"""The frame format: its layout, constants, error types and the msgpack packer both sides share.

A frame is laid out so that it can be written straight into shared memory and read back as views:

    prefix   24 bytes  magic b"OMF1", version u16, flags u16, buffer count u32, header length u32,
                       frame length u64 (all little-endian)
    lengths  8 bytes per out-of-band buffer (u64)
    header   msgpack: the object tree; tensors, arrays, images and large bytes are ext references to buffers
    buffers  each starts at a 64-byte aligned offset from the frame start, in order; a buffer that no
             leaf references is padding (the encoder uses it to place a large leaf at the page
             offset where memcpy from its source runs fastest)

Buffer offsets are not stored: both sides derive them from the lengths, so the header can be built
before its own size is known.
"""

from __future__ import annotations

import functools
import re
import struct
import threading
from typing import TYPE_CHECKING, Any

import msgpack

from omni_mesh.lazy_torch import import_torch

if TYPE_CHECKING:
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
EXT_CUDA_IPC = 6  # a CUDA tensor by IPC handle (same host only; see omni_mesh.cuda_ipc)
EXT_DEVICE_TENSOR = 7  # a tensor whose bytes travel outside the frame, into a device buffer of the consumer
EXT_SET = 8  # a set: its members as a msgpack list, like a tuple body
EXT_FROZENSET = 9
EXT_SLICE = 10  # [start, stop, step], each None, bool, int, float or str
EXT_IMAGE = 11  # a PIL image: [mode, [width, height], buffer index, palette or None] (see codec.image)

NUMPY_KINDS = frozenset("biufcmMSU")


class FrameError(ValueError):
    """A frame is malformed, truncated or hostile."""


class UnsupportedTypeError(TypeError):
    """The payload holds a value the codec does not carry (it never falls back to pickle)."""


_NOT_CARRIED = re.compile(r"q\w+|bits\w+|u?int[1-7]")


@functools.cache
def torch_dtypes() -> dict[str, torch.dtype]:
    """Carried tensor dtypes by name. Built (and torch imported) on first use: by a tensor to encode,
    or a frame whose header names one, never by a process that only moves plain values."""
    torch = import_torch()
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


@functools.cache
def dtype_names() -> dict[torch.dtype, str]:
    """The names of `torch_dtypes()`, by dtype."""
    return {dtype: name for name, dtype in torch_dtypes().items()}


def tuple_budget(header_len: int) -> int:
    """Bytes of tuple bodies a frame may carry in all. Each tuple level hands its body on as a new bytes
    object, so without a bound nested tuples would make decoding allocate depth x the frame size."""
    return 4 * header_len + 65536


def align(n: int) -> int:
    return (n + ALIGN - 1) & ~(ALIGN - 1)


def buffer_offsets(start: int, lengths: list[int]) -> list[int]:
    offsets = []
    pos = align(start)
    for length in lengths:
        offsets.append(pos)
        pos = align(pos + length)
    return offsets

_PACKERS = threading.local()


def pack(value: Any) -> bytes:
    # One packer per thread: building one per call costs more than packing a small header.
    try:
        packer = _PACKERS.packer
    except AttributeError:
        # strict_types keeps tuples (already turned into ext) from being packed as lists by mistake.
        packer = _PACKERS.packer = msgpack.Packer(strict_types=True, use_bin_type=True, datetime=False)
    return packer.pack(value)


@functools.lru_cache(maxsize=64)
def buffer_table(count: int) -> struct.Struct:
    return struct.Struct(f"<{count}Q")

