"""`NodeAdapter`: a public connector that hands its calls to the node object it composes (store and
transfer-engine connectors: `mooncake.store_node`, `datasystem.kv`, `mooncake.te_node`). The node holds
the backend, its memory and this process's keys; the adapter speaks the contract (`base.py`)."""

from __future__ import annotations

from typing import Any

from omni_mesh.connectors.base import OmniConnectorBase


class NodeAdapter(OmniConnectorBase):
    """The lifecycle calls, handed to `_node` (the subclass's __init__ builds it). A node also has
    `error()`, which counts a failure."""

    _node: Any

    def _count_put_error(self) -> None:
        self._node.error()

    def reap_consumed(self) -> None:
        """Forget (or free) what this process put that a consumer elsewhere took; expire what waited
        past ttl_s."""
        self._node.reap_consumed()

    def cleanup(self, key: str) -> None:
        """Remove what this process put under `key` or `key/...` that nobody consumed yet."""
        self._node.cleanup(key)

    def health(self) -> dict:
        return {**self._node.health(), **self._put_health()}

    def close(self) -> None:
        self._node.close()
