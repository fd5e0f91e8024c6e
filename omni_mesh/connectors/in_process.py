"""InProcessConnector: payloads between stages that share one process, and a real connector for tests.

Every InProcessConnector of one `namespace` in a process shares one store, keyed like the other
connectors (`from->to/key`), so a producer and a consumer are two instances, as two stages have. A put
stores the payload's codec frame (what crosses any other connector: a dataclass arrives as a dict, an
object the codec cannot carry fails the put) and a get decodes it once: the consumer's object never
aliases the producer's. A payload is handed out once; `cleanup(request)` drops the request's keys.
`memory_limit` bounds what one namespace holds: a put beyond it fails (ConnectorError) until gets or
cleanups make room. Nothing outlives the process, so the lifecycle is the base one (nothing to reclaim).
"""

from __future__ import annotations

import itertools
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from omni_mesh import codec
from omni_mesh.connectors.base import OmniConnectorBase
from omni_mesh.connectors.config import InProcessConfig
from omni_mesh.connectors.counters import Counters
from omni_mesh.connectors.errors import ConnectorClosed, ConnectorFull
from omni_mesh.connectors.keys import cleaned_by, edge_key, payload_name

__all__ = ["InProcessConfig", "InProcessConnector"]

#: Longest single wait of `get_with_deadline`: a wait told to stop (abandon_get) notices this soon.
WAIT_SLICE_S = 0.05


@dataclass
class _Store:
    """One namespace's payloads: edge key -> (frame, producer, put key), and the bytes they take."""

    payloads: dict[str, tuple[bytes, int, str]] = field(default_factory=dict)
    held_bytes: int = 0
    changed: threading.Condition = field(default_factory=threading.Condition)


_STORES: dict[str, _Store] = {}
_STORES_LOCK = threading.Lock()
_PRODUCERS = itertools.count()  # an id per connector instance (id() may be reused after one is freed)


def _store(namespace: str) -> _Store:
    with _STORES_LOCK:
        return _STORES.setdefault(namespace, _Store())


class InProcessConnector(OmniConnectorBase):
    config_class = InProcessConfig
    scope = "host"  # one process, so one host

    def __init__(self, config: dict[str, Any] | None = None) -> None:
        super().__init__(config)
        self._store = _store(self.config.namespace)
        self._closed = False
        self._id = next(_PRODUCERS)
        self._counters = Counters("puts", "bytes_put", "gets", "bytes_got", "cleaned")

    def _check_open(self, what: str) -> None:
        if self._closed:
            raise ConnectorClosed(
                f"InProcessConnector (namespace {self.config.namespace!r}): {what} after close()"
            )

    def _put(self, from_stage: str, to_stage: str, put_key: str, data: Any) -> tuple[int, dict | None]:
        self._check_open(f"put of {payload_name(from_stage, to_stage, put_key)}")
        frame = bytes(codec.encode(data))
        name = edge_key(from_stage, to_stage, put_key)
        store = self._store
        with store.changed:
            old = store.payloads.get(name)
            held = store.held_bytes - (len(old[0]) if old else 0)
            if held + len(frame) > self.config.memory_limit:
                raise ConnectorFull(
                    f"namespace {self.config.namespace!r} is full: {held} of {self.config.memory_limit} bytes "
                    f"held, this payload needs {len(frame)} (raise memory_limit, or get and clean up sooner)"
                )
            store.payloads[name] = (frame, self._id, put_key)
            store.held_bytes = held + len(frame)
            store.changed.notify_all()
        self._counters.add_pair("puts", "bytes_put", len(frame))
        return len(frame), {"key": name, "size": len(frame)}

    def _poll(
        self, from_stage: str, to_stage: str, get_key: str, metadata: dict | None
    ) -> tuple[Any, int] | None:
        self._check_open(f"get of {payload_name(from_stage, to_stage, get_key)}")
        store = self._store
        with store.changed:
            taken = store.payloads.pop(edge_key(from_stage, to_stage, get_key), None)
            if taken is None:
                return None
            store.held_bytes -= len(taken[0])
        frame = taken[0]
        self._counters.add_pair("gets", "bytes_got", len(frame))
        return codec.decode(frame), len(frame)

    def _wait_once(
        self, from_stage: str, to_stage: str, get_key: str, metadata: dict | None, deadline: float
    ) -> tuple[Any, int] | None:
        """Wait for a put of the key (woken by it), at most a slice, then try once."""
        name = edge_key(from_stage, to_stage, get_key)
        store = self._store
        with store.changed:
            if name not in store.payloads and not self._closed:
                store.changed.wait(max(0.0, min(WAIT_SLICE_S, deadline - time.monotonic())))
        return self.get(from_stage, to_stage, get_key, metadata)

    def cleanup(self, key: str) -> None:
        """Drop this producer's payloads of request `key` (put keys `key` and `key/...`), on every edge."""
        store = self._store
        with store.changed:
            doomed = [
                name
                for name, (_, owner, put_key) in store.payloads.items()
                if owner == self._id and cleaned_by(put_key, key)
            ]
            for name in doomed:
                store.held_bytes -= len(store.payloads.pop(name)[0])
        self._counters.add("cleaned", len(doomed))

    def _held(self) -> tuple[int, int]:
        with self._store.changed:
            mine = [frame for frame, owner, _ in self._store.payloads.values() if owner == self._id]
        return len(mine), sum(map(len, mine))

    def health(self) -> dict:
        held, held_bytes = self._held()
        return {
            "status": "unhealthy" if self._closed else "healthy",
            "namespace": self.config.namespace,
            "held": held,
            "held_bytes": held_bytes,
            **self._counters.snapshot(),
            **self._put_health(),
        }

    def close(self) -> None:
        """Drop what this producer still holds; later calls fail. Idempotent."""
        store = self._store
        with store.changed:
            self._closed = True
            for name in [name for name, (_, owner, _) in store.payloads.items() if owner == self._id]:
                store.held_bytes -= len(store.payloads.pop(name)[0])
            store.changed.notify_all()
