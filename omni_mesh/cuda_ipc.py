"""CUDA tensors between processes on one host by CUDA IPC handle: no host bounce, no pickle.

PyTorch already implements the protocol that `torch.multiprocessing` uses for CUDA tensors: the
producer exports the tensor's allocation (`reduce_tensor`: an IPC memory handle, a reference counter
shared with consumers, an IPC event recorded on the producer's stream), the consumer maps it on the
same device (`rebuild_cuda_tensor`: opens the handle once per process, waits for the event, counts its
reference). We reuse exactly those two functions, but carry only their plain fields (ints, bytes,
bools) in the msgpack header: torch's own transport pickles them, ours never does.

Lifetime, as in torch: each export counts one reference in a counter shared with the consumer, which
gives it back when its mapped tensor dies; until then the producer's caching allocator keeps the block
(in torch's "limbo"), even after the producer drops its own tensor. An export that no consumer ever
maps must give its reference back itself (`Exported.release_unmapped`), or the block is never reused.
A mapped tensor must not outlive its producer process; a consumer that keeps data longer copies it
(the connectors' `copy_on_get` clones on the consumer's device).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from omni_mesh.lazy_torch import import_torch

if TYPE_CHECKING:
    import torch

# The IPC fields after the dtype name, in the order the header carries them.
FIELDS = (
    "shape",
    "stride",
    "storage_offset",
    "device",
    "handle",
    "storage_size_bytes",
    "storage_offset_bytes",
    "ref_counter_handle",
    "ref_counter_offset",
    "event_handle",
    "event_sync_required",
)


class CudaIpcUnavailable(RuntimeError):
    """This process cannot map a CUDA tensor passed by IPC handle."""


@dataclass
class Exported:
    """One CUDA tensor exported for a consumer: the producer holds this until the payload is freed."""

    tensor: torch.Tensor
    fields: list[Any]  # msgpack-able, in FIELDS order

    def release_unmapped(self) -> None:
        """Give back the reference the export counted, for a payload that no consumer mapped."""
        named = dict(zip(FIELDS, self.fields, strict=True))
        if named["handle"] is not None:
            import_torch().UntypedStorage._release_ipc_counter(
                named["ref_counter_handle"], named["ref_counter_offset"], device=self.tensor.device
            )


def export(tensor: torch.Tensor) -> Exported:
    """Export a CUDA tensor's allocation for a consumer process on this host."""
    from torch.multiprocessing import reductions

    rebuild, args = reductions.reduce_tensor(tensor.detach())
    if rebuild is not reductions.rebuild_cuda_tensor:
        raise ValueError(f"torch does not share this tensor by CUDA IPC handle ({rebuild.__name__})")
    (_, size, stride, offset, _, _, device, handle, storage_size, storage_offset, _) = args[:11]
    ref_counter_handle, ref_counter_offset, event_handle, event_sync_required = args[11:]
    fields = [
        list(size),
        list(stride),
        offset,
        device,
        handle,
        storage_size,
        storage_offset,
        ref_counter_handle,
        ref_counter_offset,
        event_handle,
        event_sync_required,
    ]
    return Exported(tensor, fields)


def open_tensor(dtype: torch.dtype, fields: dict[str, Any]) -> torch.Tensor:
    """Map a tensor exported by `export` in another process (fields already validated by the decoder)."""
    torch = import_torch()
    if not torch.cuda.is_available():
        raise CudaIpcUnavailable(
            f"the payload holds a CUDA tensor (cuda:{fields['device']}) passed by IPC handle, and this process "
            "has no CUDA device; set `cuda_ipc: false` on the producer's SharedMemoryConnector to send CUDA "
            "tensors through host memory instead"
        )
    if fields["device"] >= torch.cuda.device_count():
        raise CudaIpcUnavailable(
            f"the payload holds a tensor on cuda:{fields['device']}, and this process sees "
            f"{torch.cuda.device_count()} CUDA device(s): give producer and consumer the same CUDA_VISIBLE_DEVICES"
        )
    from torch.multiprocessing import reductions

    return reductions.rebuild_cuda_tensor(
        torch.Tensor,
        torch.Size(fields["shape"]),
        tuple(fields["stride"]),
        fields["storage_offset"],
        torch.storage.TypedStorage,
        dtype,
        fields["device"],
        fields["handle"],
        fields["storage_size_bytes"],
        fields["storage_offset_bytes"],
        False,
        fields["ref_counter_handle"],
        fields["ref_counter_offset"],
        fields["event_handle"],
        fields["event_sync_required"],
    )
