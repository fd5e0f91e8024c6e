"""Device tensors in frames: the `split` policies that keep CUDA tensors out of host memory, and the
decode slots that bring them back.

CudaIpcExports passes a CUDA tensor by IPC handle (a consumer on the same host maps it); DeviceLeaves
leaves it out of the frame for a transport that moves it device to device itself.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import msgpack

from omni_mesh import cuda_ipc
from omni_mesh.codec.format import EXT_CUDA_IPC, EXT_DEVICE_TENSOR, FrameError, pack
from omni_mesh.codec.nodes import Buffers, TensorSlot, checked_shape, ext_fields, torch_dtype
from omni_mesh.lazy_torch import import_torch

if TYPE_CHECKING:
    import torch


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
        return msgpack.ExtType(EXT_CUDA_IPC, pack([name, *exported.fields]))


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
        return msgpack.ExtType(EXT_DEVICE_TENSOR, pack([name, list(tensor.shape), len(self.tensors) - 1]))

class CudaIpcSlot:
    """A CUDA tensor passed by IPC handle: every field is checked here, mapped only at build."""

    __slots__ = ("dtype", "fields")

    def __init__(self, fields: list[Any]) -> None:
        name, *ipc = ext_fields(fields, 1 + len(cuda_ipc.FIELDS), "CUDA IPC tensor")
        self.dtype = dtype = torch_dtype(name)
        values = dict(zip(cuda_ipc.FIELDS, ipc, strict=True))
        shape, stride = checked_shape(values["shape"]), checked_shape(values["stride"])
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

    def build(self, buffers: Buffers) -> torch.Tensor:
        local = getattr(buffers, "cuda_local", None)
        if local is not None:  # this process exported it: CUDA cannot map its own handle, take the tensor
            tensor = next(local)
            if tensor.dtype is not self.dtype or tuple(tensor.shape) != self.fields["shape"]:
                raise FrameError(f"CUDA IPC tensor of shape {list(self.fields['shape'])} does not match its export")
        else:
            tensor = cuda_ipc.open_tensor(self.dtype, self.fields)
        return tensor.clone() if buffers.copy else tensor  # the clone stays on the consumer's device


class DeviceTensorSlot(TensorSlot):
    """A tensor whose bytes arrived outside the frame, in a device buffer (see DeviceLeaves); `index`
    counts device buffers, not frame buffers."""

    __slots__ = ()

    def build(self, buffers: Any) -> torch.Tensor:
        received = getattr(buffers, "device", None) or []
        if self.index >= len(received):
            raise FrameError(f"device tensor {self.index} has no received buffer ({len(received)} given)")
        raw = received[self.index]
        torch = import_torch()  # loaded already: torch_dtype() built this slot's dtype
        if raw.dtype is not torch.uint8 or raw.dim() != 1 or raw.numel() != self.nbytes:
            raise FrameError(f"device buffer {self.index} holds {raw.numel()} bytes, its tensor needs {self.nbytes}")
        if not self.nbytes:
            return torch.empty(self.shape, dtype=self.dtype, device=raw.device)
        tensor = raw.view(self.dtype).view(self.shape)
        return tensor.clone() if buffers.copy else tensor

