"""The connectors the contract suite (tests/test_connector_contract.py) runs against, with real backends.

Each backend knows how to build producer and consumer connectors here, which partial metadata names its
producer (vllm-omni's `source_host`/`source_port`, for the connectors that ask the producer), and
which `health()` figure counts what a producer still holds. A backend whose library or service is
missing is skipped with the reason. YuanrongConnector uses the session's shared datasystem worker
(tests/support/shared_worker.py) under its own key prefix.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

from omni_mesh.connectors import OmniConnectorBase, create_connector
from support.meshkit import wait_for
from support.shared_worker import SharedWorker

BACKENDS = [
    "SharedMemoryConnector",
    "ZmqConnector",
    "MooncakeTransferEngineConnector",
    "MooncakeStoreConnector",
    "YuanrongConnector",
    "InProcessConnector",
]
#: The health() figure that counts payloads a producer still holds for consumers, per connector.
HELD = {
    "SharedMemoryConnector": "live_payloads",
    "ZmqConnector": "held",
    "MooncakeTransferEngineConnector": "pending_payloads",
    "MooncakeStoreConnector": "tracked_keys",
    "YuanrongConnector": "held",
    "InProcessConnector": "held",
}
#: The contract's namespace in the datasystem worker it shares with other modules.
KEY_PREFIX = "omnicontract"
#: Connectors whose producer serves gets itself: partial metadata names it by host and port.
ASKS_PRODUCER = {"ZmqConnector", "MooncakeTransferEngineConnector"}
#: Connectors that carry payloads inside one process only: no consumer in another process to test.
ONE_PROCESS = {"InProcessConnector"}


@dataclass
class Backend:
    name: str
    config: dict[str, Any]
    env: dict[str, str] = field(default_factory=dict)
    made: list[OmniConnectorBase] = field(default_factory=list)

    def make(self, **overrides: Any) -> OmniConnectorBase:
        """A connector of this backend (closed at the end of the module)."""
        connector = create_connector(self.name, {**self.config, **overrides})
        self.made.append(connector)
        return connector

    def partial(self, metadata: dict) -> dict | None:
        """What vllm-omni's heterogeneous-TP path passes instead of put()'s metadata: the producer's
        host and port where the connector asks its producer, nothing otherwise (the key locates it)."""
        if self.name not in ASKS_PRODUCER:
            return None
        host, port = metadata["endpoint"].removeprefix("tcp://").rsplit(":", 1)
        return {"source_host": host.strip("[]"), "source_port": int(port)}

    def held(self, connector: OmniConnectorBase) -> int:
        return connector.health()[HELD[self.name]]

    def settle(self, consumer: OmniConnectorBase) -> None:
        """Wait until `consumer` has told its producers of every payload it got (ZmqConnector confirms
        off the get's path), so that a producer's `held` counts no payload already consumed."""
        wait_for(lambda: consumer.health().get("confirms_pending", 0) == 0, 10, f"{self.name}'s confirmations to leave")

    def close(self) -> None:
        for connector in self.made:
            with contextlib.suppress(Exception):
                connector.close()


def _absent(reason: str) -> None:
    """Skip a backend that is not here, with the reason; under CI (where `make test` installed every
    backend) its absence is a broken install step and fails loudly instead."""
    if os.environ.get("CI"):
        pytest.fail(f"{reason} (CI installs every backend: the install step is broken)")
    pytest.skip(reason)


def _missing(module: str) -> bool:
    return importlib.util.find_spec(module) is None


@contextlib.contextmanager
def running(name: str, logs: Any, datasystem: SharedWorker) -> Iterator[Backend]:
    """Start what `name` needs (a mooncake_master; the session's datasystem worker, `datasystem`, is
    started on first use) and yield its Backend."""
    if name == "SharedMemoryConnector":
        backend = Backend(name, {})
        yield backend
        backend.close()
    elif name == "InProcessConnector":
        backend = Backend(name, {"namespace": f"contract-{os.getpid()}"})
        yield backend
        backend.close()
    elif name == "ZmqConnector":
        backend = Backend(name, {"host": "127.0.0.1", "memory_pool_size": "64MiB"})
        yield backend
        backend.close()
    elif name == "MooncakeTransferEngineConnector":
        if _missing("mooncake"):
            _absent("mooncake is not installed: pip install mooncake-transfer-engine")
        backend = Backend(
            name, {"host": "127.0.0.1", "memory_pool_size": "64MiB", "prefault": False, "connect_timeout_s": 2.0}
        )
        yield backend
        backend.close()
    elif name == "MooncakeStoreConnector":
        from omni_mesh.connectors import ConnectorError
        from omni_mesh.local_services.mooncake_master import MooncakeMaster, master_binary

        try:
            master_binary()
        except ConnectorError as exc:
            _absent(f"no mooncake_master here: {exc}")

        with MooncakeMaster(log_path=str(logs / "master.log")) as master:
            config = {
                "host": "127.0.0.1",
                "master": master.address,
                "segment": "128MiB",
                "localbuf": "64MiB",
                "prefault": False,
            }
            backend = Backend(name, config)
            yield backend
            backend.close()
    elif name == "YuanrongConnector":
        if _missing("yr.datasystem"):
            _absent("openyuanrong-datasystem is not installed")
        try:
            worker = datasystem.get()
        except (RuntimeError, FileNotFoundError, OSError) as exc:
            _absent(f"no datasystem worker could be started here: {exc}")
        # Only what the worker set up differs from this process's environment (its client log dir).
        env = {k: v for k, v in worker.env.items() if os.environ.get(k) != v}
        backend = Backend(name, {**worker.config, "key_prefix": KEY_PREFIX}, env=env)
        yield backend
        backend.close()
    else:
        raise ValueError(name)
