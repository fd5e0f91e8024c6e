"""Device-to-device tensors for the transfer-engine connectors: which tensors go, where they land.

With Mooncake's CUDA wheel (`mooncake-transfer-engine`, extra `mooncake-cuda`) the engine reads and
writes GPU memory itself. A CUDA tensor in a payload then stays out of the frame (codec.DeviceLeaves):
the producer registers the tensor's memory, the consumer allocates a buffer of the same size on its
current CUDA device and registers it, and the producer's engine writes GPU to GPU beside the frame. The
non-CUDA wheel cannot touch GPU memory, so there CUDA tensors go through host memory as before.

Test seam: with OMNI_MESH_DEVICE_LEAVES_ON_HOST_MIN_BYTES=N, CPU tensors of at least N bytes take the
same path with receive buffers in host memory, so the protocol runs for real on machines without GPUs.
"""

from __future__ import annotations

import functools
import os
from importlib import metadata
from typing import Any

import torch

from omni_mesh import codec

HOST_SEAM = "OMNI_MESH_DEVICE_LEAVES_ON_HOST_MIN_BYTES"
CUDA_WHEEL = "mooncake-transfer-engine"  # the non-CUDA wheel is mooncake-transfer-engine-non-cuda


@functools.cache
def engine_reaches_gpu_memory() -> bool:
    """Whether the installed Mooncake wheel is the CUDA build."""
    try:
        metadata.distribution(CUDA_WHEEL)
    except metadata.PackageNotFoundError:
        return False
    return True


def host_seam_bytes() -> int:
    try:
        return max(0, int(os.environ.get(HOST_SEAM, "0")))
    except ValueError:
        return 0


def policy(enabled: bool) -> codec.DeviceLeaves | None:
    """The split policy of one put: None sends every tensor through the frame (host memory)."""
    seam = host_seam_bytes()
    if not enabled or not (seam or engine_reaches_gpu_memory()):
        return None
    return codec.DeviceLeaves(host_min_bytes=seam)


def settle(tensors: list[torch.Tensor]) -> None:
    """Wait for the kernels still writing these tensors: the engine reads memory, not CUDA streams."""
    for device in {t.device for t in tensors if t.is_cuda}:
        torch.cuda.current_stream(device).synchronize()


def receive_buffers(sizes: list[int]) -> list[torch.Tensor]:
    """One flat uint8 buffer per device tensor, on this process's current CUDA device (host memory
    under the test seam, or where this process has no CUDA)."""
    on_gpu = torch.cuda.is_available() and not host_seam_bytes()
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    return [torch.empty(size, dtype=torch.uint8, device=device) for size in sizes]


MAX_TENSORS = 4096  # device tensors of one payload
MAX_BYTES = 1 << 40  # their bytes in all


def sizes_ok(sizes: Any) -> bool:
    """A metadata 'device' list a consumer may allocate receive buffers for (a hostile list must not
    make it allocate without bound)."""
    return (
        isinstance(sizes, list)
        and len(sizes) <= MAX_TENSORS
        and all(type(n) is int and n >= 0 for n in sizes)
        and sum(sizes) <= MAX_BYTES
    )


def addresses_match(addresses: Any, tensors: list[torch.Tensor]) -> bool:
    """The consumer sent one receive address per device tensor (0 only for an empty one)."""
    if not isinstance(addresses, list) or len(addresses) != len(tensors):
        return False
    return all(type(a) is int and (a > 0 or not t.nbytes) for a, t in zip(addresses, tensors, strict=True))
