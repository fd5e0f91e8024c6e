"""Device-to-device tensors for the transfer-engine connectors: which tensors go, where they land.

With Mooncake's CUDA wheel (`mooncake-transfer-engine`, extra `mooncake-cuda`) the engine reads and
writes GPU memory itself. A CUDA tensor in a payload then stays out of the frame (codec.DeviceLeaves):
the producer registers the tensor's memory, the consumer allocates a buffer of the same size on its
current CUDA device and registers it, and the producer's engine writes GPU to GPU beside the frame. The
non-CUDA wheel cannot touch GPU memory, so there CUDA tensors go through host memory as before.

A connector decides which tensors take the path with a `DeviceLeavesPolicy`, from its
`device_leaves_policy()` hook; a test subclass overrides the hook to send CPU tensors the same way
(receive buffers in host memory), so the protocol runs for real on machines without GPUs.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from importlib import metadata
from typing import Any

import torch

from omni_mesh import codec

CUDA_WHEEL = "mooncake-transfer-engine"  # the non-CUDA wheel is mooncake-transfer-engine-non-cuda


@functools.cache
def engine_reaches_gpu_memory() -> bool:
    """Whether the installed Mooncake wheel is the CUDA build."""
    try:
        metadata.distribution(CUDA_WHEEL)
    except metadata.PackageNotFoundError:
        return False
    return True


@dataclass(frozen=True)
class DeviceLeavesPolicy:
    """Which tensors of a payload go device to device, and where a consumer receives them.

    `enabled`: CUDA tensors leave the frame. `host_min_bytes` > 0: CPU tensors that large leave it
    too, and receive buffers live in host memory (how tests run the protocol without a GPU).
    """

    enabled: bool
    host_min_bytes: int = 0

    def split(self) -> codec.DeviceLeaves | None:
        """The split policy of one put: None sends every tensor through the frame (host memory)."""
        return codec.DeviceLeaves(host_min_bytes=self.host_min_bytes) if self.enabled else None

    def receive_buffers(self, sizes: list[int]) -> list[torch.Tensor]:
        """One flat uint8 buffer per device tensor, on this process's current CUDA device (host
        memory when CPU tensors take the path, or where this process has no CUDA)."""
        on_gpu = torch.cuda.is_available() and not self.host_min_bytes
        device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
        return [torch.empty(size, dtype=torch.uint8, device=device) for size in sizes]


def default_policy(enabled: bool) -> DeviceLeavesPolicy:
    """The production policy: CUDA tensors go device to device when the config allows it and the
    installed engine reaches GPU memory."""
    return DeviceLeavesPolicy(enabled and engine_reaches_gpu_memory())


def settle(tensors: list[torch.Tensor]) -> None:
    """Wait for the kernels still writing these tensors: the engine reads memory, not CUDA streams."""
    for device in {t.device for t in tensors if t.is_cuda}:
        torch.cuda.current_stream(device).synchronize()


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
