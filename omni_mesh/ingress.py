"""Request inputs too large for a control message: they reach the entry stages through a connector.

A control message carries metadata only (`control.MAX_MESSAGE_BYTES`), but a request body may be up
to the REST limit (16 MiB). Inputs whose msgpack form exceeds `INLINE_MAX_BYTES` are put into a
`ZmqConnector` the coordinator owns (CURVE-protected with the mesh keys like every side channel, its
large payloads sealed per transfer on its bulk socket: docs/security.md), and
the entry stage's work message carries only the reference; the stage fetches them like any other
payload. The coordinator releases what it holds when the request ends.
"""

from __future__ import annotations

import asyncio
import contextlib
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from omni_mesh.connectors import OmniConnectorBase, create_connector
from omni_mesh.ports import WILDCARDS

#: Inputs larger than this (packed) go through the ingress connector; smaller ones ride inline.
INLINE_MAX_BYTES = 512 * 1024
#: The name the entry stages see as the producer of a request's inputs.
SOURCE = "request"
CONNECTOR = "ZmqConnector"


def connector_config(control_endpoint: str) -> dict[str, Any]:
    """The ingress connector listens where the control plane does: stages that reach one reach both."""
    host = control_endpoint.removeprefix("tcp://").rsplit(":", 1)[0].strip("[]")
    return {"host": "0.0.0.0" if host in WILDCARDS else host, "memory_pool_size": 64 << 20}


def consumer() -> OmniConnectorBase:
    """The connector a stage fetches large inputs with (it serves nothing itself)."""
    return create_connector(CONNECTOR, {})


class Ingress:
    """The coordinator's side: put a request's inputs for each entry stage, release them at the end."""

    def __init__(self, control_endpoint: str) -> None:
        self._config = connector_config(control_endpoint)
        self._connector: OmniConnectorBase | None = None
        self._executor = ThreadPoolExecutor(max_workers=2, thread_name_prefix="ingress")
        self._attempts = 0

    async def put(self, rid: str, stage: str, inputs: Any) -> dict[str, Any]:
        """Hold `inputs` for `stage` (off the event loop: this copies megabytes); the work's `inputs_ref`."""
        if self._connector is None:
            self._connector = create_connector(CONNECTOR, self._config)
        self._attempts += 1
        key = f"{rid}/{stage}/{self._attempts}"  # every attempt its own key: a get consumes the payload
        loop = asyncio.get_running_loop()
        # Raises ConnectorFull when its memory is full (the coordinator answers 503).
        _size, meta = await loop.run_in_executor(
            self._executor, self._connector.put_or_raise, SOURCE, stage, key, inputs
        )
        return {"key": key, "meta": meta}

    def health(self) -> dict[str, Any]:
        """The ingress connector's counters ({} until the first large request)."""
        return self._connector.health() if self._connector is not None else {}

    def release(self, rid: str) -> None:
        if self._connector is not None:
            self._connector.cleanup(rid)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
        if self._connector is not None:
            with contextlib.suppress(Exception):
                self._connector.close()
