"""MooncakeTransferEngineConnector: point-to-point payloads over Mooncake's Transfer Engine (TCP or RDMA).

Each instance (a stage process holds one per connector it names) registers ONE pre-allocated pool
with its engine and owns a small ZeroMQ side channel bound to `host`.

    put   plan the frame with the codec and lay it straight into a pool region (no staging copy);
          the metadata names where it lives: engine segment, side-channel endpoint, handle, length.
    get   reserve a region of the same length in the consumer's own pool and ask the producer, over
          the side channel, to WRITE the frame there (`te_pull`: one engine write (`te_write`), the
          engine's well-trodden direction on every transport). The producer frees its region once the
          write has landed; the consumer decodes views over its region (`te_receive`).

Over TCP, contiguous CPU leaves of at least `zero_copy_min_bytes` are sent from their own memory, not
copied at put (`mooncake.frame_pieces`): a handler MUST NOT mutate a tensor or array after returning
it until the payload is consumed or freed, or the consumer receives the mutated bytes. Registering
costs about 1.5 us + 1.2 us over TCP (60 us the first time); under RDMA it pins memory, not measured,
so other protocols keep the put-time copy. CUDA tensors go GPU to GPU beside the frame
(`mooncake.device_transfer`). Unconsumed payloads are freed `ttl_s` after their put; a consumer's
timed-out region stays quarantined until the late answer or `ttl_s` (`te_pull`). Calls block only the
calling thread; the side channel's thread reaps, a few transfer threads write.

Metadata (msgpack-able): {"segment": engine segment name (`host:rpc_port` with P2PHANDSHAKE),
"endpoint": "tcp://host:port", "session": producer instance id, "handle": int, "addr": producer pool
address, "length": frame bytes, "key": "from->to/put_key"[, "device": [bytes of each device tensor]]}.
The producer checks session, handle, key, length and the device buffers before it writes anything.

The machinery is `mooncake.te_node` and its neighbours in `mooncake/`; engine return codes map to
the connectors' exception family in `mooncake.errors`.
"""

from __future__ import annotations

from typing import Any

import torch

from omni_mesh.connectors.config import MooncakeTransferEngineConfig
from omni_mesh.connectors.mooncake import device_transfer
from omni_mesh.connectors.mooncake.loading import close_at_exit
from omni_mesh.connectors.mooncake.te_node import TransferEngineNode
from omni_mesh.connectors.node_adapter import NodeAdapter

__all__ = ["MooncakeTransferEngineConfig", "MooncakeTransferEngineConnector"]


class MooncakeTransferEngineConnector(NodeAdapter):
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
