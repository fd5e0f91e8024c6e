"""Decoding frames: the whole-frame form (`decode`) and the parts form (`decode_parts`).

Decoding never trusts the frame: every length, shape, dtype and offset is checked against the bytes
actually present, and nothing larger than the frame is ever allocated. Any malformed input surfaces
as FrameError.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from omni_mesh import cuda_ipc
from omni_mesh.codec.format import MAGIC, PREFIX, VERSION, FrameError, buffer_offsets, buffer_table
from omni_mesh.codec.nodes import Buffers, DictNode, Parts, TensorSlot
from omni_mesh.codec.template import TEMPLATE_CACHE_SIZE, template_of
from omni_mesh.lazy_torch import import_torch

if TYPE_CHECKING:
    import torch


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
        if type(buffer) is bytes and not offset and not copy and device_buffers is None:
            flat = _known_flat(buffer)
            if flat is not None:  # a whole tiny frame from a message, with a head seen before
                return _flat_views(bytearray(buffer), 0, flat)  # views must be writable: copy it once
        return _decode(buffer, offset, copy, device_buffers, cuda_local)
    except Exception as exc:
        raise _frame_error(exc) from None


def _known_flat(frame: bytes) -> tuple | None:
    """The flat layout of a whole frame whose head was read (and checked) before, else None: the
    cheapest decode of the usual tiny payload, a dict of tensors carried in its metadata."""
    if len(frame) < PREFIX.size:
        return None
    _magic, _version, _flags, count, header_len, nbytes = PREFIX.unpack_from(frame)
    if nbytes != len(frame):
        return None
    layout = _HEADS.get(frame[: PREFIX.size + 8 * count + header_len])  # a cached head was checked whole
    return None if layout is None else layout[3]


def _flat_views(buffer: Any, offset: int, flat: tuple) -> dict:
    """A dict of tensors as views straight off `buffer`, its layout already checked against its head."""
    torch, items = flat
    out = {}
    for key, dtype, count, at, shape in items:
        if count:
            tensor = torch.frombuffer(buffer, dtype=dtype, count=count, offset=offset + at)
            out[key] = tensor if shape is None else tensor.view(shape)  # view() costs as much again
        else:
            out[key] = torch.empty(shape or (0,), dtype=dtype)
    return out


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
        return _flat_views(buffer, offset, flat)  # a dict of tensors, already checked against this head
    buffers = Buffers(buffer, offset, offsets, lengths, copy)
    buffers.device = device_buffers
    buffers.cuda_local = None if cuda_local is None else iter(cuda_local)
    return template.build(buffers)


# Decoding layouts by frame head (prefix, buffer table and header), cached for the same reason as
# the encoding layouts in `frame`.
HEAD_CACHE_MAX = 8192  # larger heads are read each time, not kept
_HEADS: dict[bytes, tuple[Any, list[int], list[int], tuple | None]] = {}


def _read_head(
    head: bytes, count: int, header_len: int, nbytes: int
) -> tuple[Any, list[int], list[int], tuple | None]:
    """(template, buffer offsets, buffer lengths, flat) of a frame head, validated against the frame
    size; `flat` is set for a dict of tensors whose buffers all check out (see _flat_tensors)."""
    table_end = PREFIX.size + 8 * count
    lengths = list(buffer_table(count).unpack_from(head, PREFIX.size)) if count else []
    offsets = buffer_offsets(table_end + header_len, lengths)
    if lengths and offsets[-1] + lengths[-1] > nbytes:
        raise FrameError(f"buffer table overruns the frame ({offsets[-1] + lengths[-1]} > {nbytes} bytes)")
    template, cacheable = template_of(head[table_end:], header_len)
    layout = (template, offsets, lengths, _flat_tensors(template, offsets, lengths))
    if cacheable and len(head) <= HEAD_CACHE_MAX:
        if len(_HEADS) >= TEMPLATE_CACHE_SIZE:
            _HEADS.clear()  # hostile variety only costs re-reading, never memory
        _HEADS[head] = layout
    return layout


def _flat_tensors(template: Any, offsets: list[int], lengths: list[int]) -> tuple | None:
    """For a dict whose values are all tensors: (torch, items), items (key, dtype, element count, buffer
    offset, shape or None for 1-D) per item, with every buffer already checked to hold exactly its
    tensor; else None. The torch module rides along: the hot path gets it without a call."""
    if type(template) is not DictNode:
        return None
    flat = []
    for key, slot in template.items:
        if type(slot) is not TensorSlot or slot.index >= len(lengths) or lengths[slot.index] != slot.nbytes:
            return None  # the general path decodes it, or raises the precise error
        shape = None if len(slot.shape) == 1 else slot.shape  # 1-D: frombuffer's result as it is
        flat.append((key, slot.dtype, slot.numel, offsets[slot.index], shape))
    return (import_torch(), tuple(flat)) if flat else None  # (tensor slots: torch is loaded already)


def decode_parts(header: bytes, parts: list[Any], *, copy: bool = False) -> Any:
    """Decode the parts form (`split` + `leaf_buffers`): a header and one buffer per leaf."""
    try:
        if type(header) is not bytes or type(parts) is not list:
            raise FrameError("parts form needs a bytes header and a list of buffers")
        return template_of(header, len(header))[0].build(Parts(parts, copy))
    except Exception as exc:
        raise _frame_error(exc) from None
