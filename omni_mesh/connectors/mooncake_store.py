"""MooncakeStoreConnector: payloads through a Mooncake distributed store (`mooncake_master` + clients).

Every process runs one store client that may contribute `segment` bytes to the cluster-wide pool, and
owns one local buffer (`localbuf`) registered with the store, which puts and gets go through with no
other copy (`mooncake.store_node`; return codes mapped in `mooncake.errors`).

Store keys are `key_prefix + "from->to/put_key"`, so two edges never collide on one request key and
omni-mesh never collides with other users of the same master. Keys nobody consumes are removed
`ttl_s` after their put by the producer; `cleanup(request_id)` removes a request's keys now.

Metadata: {"key": store key, "length": frame bytes}. `get` also works without metadata (the key is
derived from the edge and put_key) and then learns the length from the store.
"""

from __future__ import annotations

from typing import Any

from omni_mesh.connectors.config import MooncakeStoreConfig
from omni_mesh.connectors.keys import edge_key, payload_name
from omni_mesh.connectors.mooncake.loading import INSTALL_HINT, close_at_exit, import_mooncake
from omni_mesh.connectors.mooncake.store_node import StoreNode
from omni_mesh.connectors.node_adapter import NodeAdapter
from omni_mesh.connectors.pools.registered import RegisteredPool

# INSTALL_HINT, RegisteredPool and import_mooncake are public here for the raw-Mooncake bench and the
# test master, which must not reach into the private `mooncake` package.
__all__ = [
    "INSTALL_HINT",
    "MooncakeStoreConfig",
    "MooncakeStoreConnector",
    "RegisteredPool",
    "import_mooncake",
]


class MooncakeStoreConnector(NodeAdapter):
    config_class = MooncakeStoreConfig
    scope = "network"

    def __init__(self, config: dict[str, Any] | None = None) -> None:
        super().__init__(config)  # validates before the backend is looked for
        self._node = StoreNode(self.config)
        self.host = self._node.host
        close_at_exit(self)

    def _put(self, from_stage: str, to_stage: str, put_key: str, data: Any) -> tuple[int, dict | None]:
        where = payload_name(from_stage, to_stage, put_key)
        return self._node.put(self._store_key(from_stage, to_stage, put_key), put_key, data, where)

    def _poll(
        self, from_stage: str, to_stage: str, get_key: str, metadata: dict | None
    ) -> tuple[Any, int] | None:
        where = payload_name(from_stage, to_stage, get_key)
        return self._node.get(self._store_key(from_stage, to_stage, get_key), metadata, where)

    def _store_key(self, from_stage: str, to_stage: str, put_key: str) -> str:
        return self.config.key_prefix + edge_key(from_stage, to_stage, put_key)
