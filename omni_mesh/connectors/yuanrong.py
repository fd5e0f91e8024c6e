"""YuanrongConnector: payloads kept by an openYuanrong datasystem worker (KV API, `yr.datasystem`).

Install with `pip install 'omni-mesh[yuanrong]'`; start a worker with `dscli start -w --worker_address
HOST:PORT ...` on every host. The producer lays each frame straight into the worker's shared memory;
the consumer reads it from there with one copy, then the key is deleted; each client call is kept
short, as the client holds the GIL while it blocks (`datasystem.kv`).

Keys (`datasystem.keys`) are `<key_prefix>;<edge key>`, percent-escaped into the datasystem's charset:
`thinker->talker/req-1/0` becomes `omni;thinker-%3Etalker%2Freq-1%2F0`. Unconsumed payloads are
deleted by the worker after `ttl_s`, or by `cleanup(request_id)`. A frame over 4 GiB - 1 (the
datasystem's value limit) is PayloadTooLarge; the worker's failures are mapped to the connectors'
exception family in `datasystem.errors`.
"""

from __future__ import annotations

import time
from typing import Any

from omni_mesh.connectors.config import YuanrongConfig
from omni_mesh.connectors.datasystem.errors import INSTALL_HINT
from omni_mesh.connectors.datasystem.keys import client_log_dir, datasystem_key
from omni_mesh.connectors.datasystem.kv import KVNode
from omni_mesh.connectors.keys import edge_key
from omni_mesh.connectors.node_adapter import NodeAdapter

# Re-exported: the raw-datasystem bench and tests read them here (datasystem/ is private).
__all__ = ["INSTALL_HINT", "YuanrongConfig", "YuanrongConnector", "client_log_dir", "datasystem_key"]


class YuanrongConnector(NodeAdapter):
    """Payloads through an openYuanrong datasystem worker (module docstring)."""

    config_class = YuanrongConfig
    scope = "network"

    def __init__(self, config: dict[str, Any] | None = None) -> None:
        super().__init__(config)  # validates before the worker is contacted
        self._node = KVNode(self.config)
        self.worker = self._node.worker
        self._where_from = f" on datasystem worker {self.worker}"  # for the deadline's error

    def _put(self, from_stage: str, to_stage: str, put_key: str, data: Any) -> tuple[int, dict | None]:
        where = f"YuanrongConnector: put {from_stage}->{to_stage} key {put_key!r}"
        return self._node.put(edge_key(from_stage, to_stage, put_key), put_key, data, where)

    def _poll(
        self, from_stage: str, to_stage: str, get_key: str, metadata: dict | None
    ) -> tuple[Any, int] | None:
        """One short call to the worker: None while the key is not there. Works with metadata=None too
        (the key derives from edge and get_key)."""
        return self._get(from_stage, to_stage, get_key, metadata, time.monotonic())

    def _wait_once(
        self, from_stage: str, to_stage: str, get_key: str, metadata: dict | None, deadline: float
    ) -> tuple[Any, int] | None:
        # Waits in slices of a second at most, so abandon_get and the deadline are noticed in time.
        return self._get(from_stage, to_stage, get_key, metadata, min(deadline, time.monotonic() + 1.0))

    def _get(
        self, from_stage: str, to_stage: str, get_key: str, metadata: Any, deadline: float
    ) -> tuple[Any, int] | None:
        where = f"YuanrongConnector: get {from_stage}->{to_stage} key {get_key!r}"
        return self._node.get(edge_key(from_stage, to_stage, get_key), metadata, deadline, where)

    def flush(self) -> None:
        """Delete every consumed key now (close does this too)."""
        self._node.flush()
