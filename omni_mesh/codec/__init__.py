"""Zero-copy framing of stage artifacts.

A frame is a msgpack header plus out-of-band buffers, laid out so it can be written straight into
shared memory and read back as views (the layout is in `format`). There is no pickle anywhere, and no
class is ever imported because a frame names it: bytes from another process are untrusted.

Carried types: dicts, lists, tuples (they stay tuples), sets and frozensets (they stay themselves),
slices, str, int (64-bit), float, bool, None, bytes, torch tensors (every carried dtype and layout;
torch.Size arrives as a tuple), numpy arrays and scalars, PIL images (pixels out of band; Pillow
optional, see `image`), dataclass instances (they arrive as dicts of their fields, as vllm-omni
sends them) and subclasses of the base types (they arrive as their base).

torch is imported only where a tensor is: encoding looks for tensors once torch is loaded (a process
without it holds none), decoding loads it for a frame whose header names a tensor dtype
(`omni_mesh.lazy_torch`); plain values and numpy arrays never need it.

The package, one concept a module:

    format    the frame layout, constants, error types, the shared msgpack packer
    frame     FramePlan: a planned frame, laid whole (`write_into`, `write_at`) or as pieces (`pieces()`)
    encode    the walker and the planners: `split`, `plan`, `encode`
    device    device tensors: the CudaIpcExports / DeviceLeaves policies and their decode slots
    image     PIL images: their header fields, raw sizes and decode slot (Pillow imported lazily)
    nodes     the nodes of a decode template (containers, constants, slots)
    template  the decode-template compiler and its cache
    decode    `decode`, `decode_parts`, `frame_length`
"""

from omni_mesh.codec.decode import decode, decode_parts, frame_length
from omni_mesh.codec.device import CudaIpcExports, DeviceLeaves
from omni_mesh.codec.encode import encode, plan, plan_flat, split
from omni_mesh.codec.format import (
    ALIGN,
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
    INLINE_BYTES_MAX,
    MAGIC,
    MAX_NDIM,
    MAX_TUPLE_DEPTH,
    PAGE,
    PAGE_MATCH_MIN,
    PREFIX,
    VERSION,
    FrameError,
    UnsupportedTypeError,
    align,
    torch_dtypes,
)
from omni_mesh.codec.frame import FramePlan, Piece, leaf_buffers

__all__ = [
    "ALIGN",
    "EXT_BYTES",
    "EXT_CUDA_IPC",
    "EXT_DEVICE_TENSOR",
    "EXT_FROZENSET",
    "EXT_IMAGE",
    "EXT_NDARRAY",
    "EXT_NPSCALAR",
    "EXT_SET",
    "EXT_SLICE",
    "EXT_TENSOR",
    "EXT_TUPLE",
    "INLINE_BYTES_MAX",
    "MAGIC",
    "MAX_NDIM",
    "MAX_TUPLE_DEPTH",
    "PAGE",
    "PAGE_MATCH_MIN",
    "PREFIX",
    "torch_dtypes",
    "VERSION",
    "CudaIpcExports",
    "DeviceLeaves",
    "FrameError",
    "FramePlan",
    "Piece",
    "UnsupportedTypeError",
    "align",
    "decode",
    "decode_parts",
    "encode",
    "frame_length",
    "leaf_buffers",
    "plan",
    "plan_flat",
    "split",
]
