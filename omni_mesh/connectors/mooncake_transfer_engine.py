"""MooncakeTransferEngineConnector: point-to-point payloads over Mooncake's Transfer Engine (TCP or RDMA).

Each instance (a stage process holds one per connector it names) registers ONE pre-allocated pool
with its engine and owns a small ZeroMQ side channel bound to `host`.

    put   plan the frame with the codec and lay it straight into a pool region (no staging copy);
          the metadata names where it lives: engine segment, side-channel endpoint, handle, length.
    get   reserve a region of the same length in the consumer's own pool and ask the producer, over
          the side channel, to WRITE the frame there (one `transfer_sync_write`, the engine's
          well-trodden direction on every transport). The producer frees its region as soon as the
          write has landed; the consumer decodes the frame as views over its region, which goes back
          to the pool when the last view is garbage-collected (or copies it out: `copy_on_get`).

Large leaves (protocol "tcp"): contiguous CPU tensors and numpy arrays of at least `zero_copy_min_bytes` are
not copied at put. The producer keeps a reference to each, registers its memory with the engine, lays only
the frame's head and small leaves into its pool, and at the consumer's request writes those pieces and each
large leaf straight from its own memory to their frame offsets in the consumer's region (one
`batch_transfer_sync_write`; see `mooncake.frame_pieces`). The consumer sees the same frame, byte for byte.
The registration is dropped when the payload is freed (consumed, expired, cleaned up or closed). So a
handler MUST NOT mutate a tensor or array after returning it (putting it) until the payload is consumed or
freed: the consumer would receive the mutated bytes. Register and unregister cost a few microseconds each
over TCP (measured: about 1.5 us + 1.2 us, 60 us for the very first); under RDMA they pin memory, which was
not measured, so other protocols keep the put-time copy.

CUDA tensors (`device_transfer`, with Mooncake's CUDA wheel): they stay out of the frame. The producer
registers each tensor's GPU memory and lists the sizes in the metadata; the consumer allocates and
registers receive buffers on its current CUDA device, and the batch write that delivers the frame writes
them GPU to GPU (`mooncake.device_transfer`).

Reclaim: unconsumed payloads are freed `ttl_s` after their put; `cleanup(request_id)` frees a
request's payloads; `close()` frees everything. A consumer whose request timed out keeps its region
reserved ("quarantined") until the producer's late answer arrives or `ttl_s` passes, so a late write
can never land in memory that was handed out again (the side channel's protocol: `te_pull`).

Threads: calls block only the calling thread (asyncio code uses `asyncio.to_thread`). The side
channel is the connectors' shared one (a `RouterServer`, asked through a `DealerPool`, started at
construction: with a metadata server its port names the segment); its thread also reaps expired
payloads and quarantined regions. A small pool of transfer threads performs the writes and answers
when each is done, so one large transfer does not hold up the others.

Metadata (msgpack-able): {"segment": engine segment name (`host:rpc_port` with P2PHANDSHAKE),
"endpoint": "tcp://host:port", "session": producer instance id, "handle": int, "addr": producer pool
address, "length": frame bytes, "key": "from->to/put_key"[, "device": [bytes of each device tensor]]}.
The producer checks session, handle, key, length and the device buffers before it writes anything.

The machinery is `mooncake.te_node` (engine, pool, side channel, producer side) with te_engine,
te_payloads, te_outputs (`empty()`), te_receive (one get), te_pull (the protocol), frame_pieces,
registrations and device_transfer; engine return codes are mapped to the connectors' exception family
in `mooncake.errors` (a frame past max_pool_size is PayloadTooLarge, a pool with no room in
pool_wait_s ConnectorFull).
"""

from __future__ import annotations

from typing import Any

import torch

from omni_mesh.connectors.base import OmniConnectorBase
from omni_mesh.connectors.config import MooncakeTransferEngineConfig
from omni_mesh.connectors.mooncake import device_transfer
from omni_mesh.connectors.mooncake.loading import close_at_exit
from omni_mesh.connectors.mooncake.te_node import TransferEngineNode

__all__ = ["MooncakeTransferEngineConfig", "MooncakeTransferEngineConnector"]


class MooncakeTransferEngineConnector(OmniConnectorBase):
    config_class = MooncakeTransferEngineConfig

    def __init__(self, config: dict[str, Any] | None = None) -> None:
        super().__init__(config)  # validates before the backend is looked for
        self._node = TransferEngineNode(self.config, self.device_leaves_policy())
        self.host, self.endpoint, self.segment = self._node.host, self._node.endpoint, self._node.segment
        close_at_exit(self)

    def device_leaves_policy(self) -> device_transfer.DeviceLeavesPolicy:
        """Which tensors go device to device beside the frame (asked once, at construction). Tests
        override it to send CPU tensors that way on machines without GPUs."""
        return device_transfer.default_policy(self.config.device_transfer)

    def empty(self, shape: tuple[int, ...] | list[int], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialized tensor over a region of the registered pool: returned in a put's payload,
        the engine sends it from there (nothing is copied at put; `te_outputs`). The region goes back
        when the tensor and the payloads holding it are gone. Do not write into it after the put."""
        return self._node.empty(shape, dtype)

    def _put(self, from_stage: str, to_stage: str, put_key: str, data: Any) -> tuple[int, dict | None]:
        return self._node.put(from_stage, to_stage, put_key, data)

    def _count_put_error(self) -> None:
        self._node.counters.add("errors")

    def _poll(
        self, from_stage: str, to_stage: str, get_key: str, metadata: dict | None
    ) -> tuple[Any, int] | None:
        """A poll: None when the producer has no such payload (any more) or, by key alone, cannot be
        reached within a second. A transfer under way is waited for (transfer_timeout_s)."""
        return self._node.get(from_stage, to_stage, get_key, metadata, poll=True)

    def _wait_once(
        self, from_stage: str, to_stage: str, get_key: str, metadata: dict | None, deadline: float
    ) -> tuple[Any, int] | None:
        return self._node.get(from_stage, to_stage, get_key, metadata, poll=False, deadline=deadline)

    def reap_consumed(self) -> None:
        """Expire payloads past ttl_s and end quarantines whose late answer came (the side channel's
        thread does this every tick; a caller may do it now)."""
        self._node.reap_consumed()

    def cleanup(self, key: str) -> None:
        """Free the payloads this process put under `key` or `key/...` that nobody consumed yet (one
        being written is freed when its write ends)."""
        self._node.cleanup(key)

    def health(self) -> dict:
        return {**self._node.health(), **self._put_health()}

    def close(self) -> None:
        self._node.close()
