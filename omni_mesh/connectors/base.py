"""The connector contract: how a payload crosses one edge of the stage graph.

A connector is built from the `extra:` mapping of a topology's connector entry. The producer side
calls `put` and sends the returned metadata (small, msgpack-serialisable) over the control plane; the
consumer side, in another process and possibly on another host, builds a connector from the same
config and calls `get` with that metadata. Implementations are blocking: asyncio code calls them
through `asyncio.to_thread` (or an executor) and never on the event loop.

This module is the contract only. Its helpers live beside it: `errors` (the one exception family),
`config.parse` (configs), `waits` (polling and abandoned gets), `put_errors` (why a put failed), `counters`,
`lifecycle` (what a type holds beyond its process). Their names are re-exported here for connectors
written against this module.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar

from omni_mesh.connectors.config.fields import Size as Size
from omni_mesh.connectors.config.fields import parse_size as parse_size
from omni_mesh.connectors.config.parse import parse_config
from omni_mesh.connectors.counters import Counters as Counters
from omni_mesh.connectors.errors import ConnectorConfigError as ConnectorConfigError
from omni_mesh.connectors.errors import ConnectorError as ConnectorError
from omni_mesh.connectors.errors import PayloadMissing
from omni_mesh.connectors.lifecycle import Lifecycle
from omni_mesh.connectors.put_errors import PutErrors
from omni_mesh.connectors.waits import POLL_MAX_S as POLL_MAX_S
from omni_mesh.connectors.waits import Waits


class OmniConnectorBase(ABC):
    """One connector instance per process and config; safe to call from several threads.

    The contract is vllm-omni's: `put` never raises for a payload it cannot store (it returns
    `(False, 0, None)` and says why in a log line and the `put_failures` counter of `health()`);
    `get` is a poll that returns None while the payload is not there (yet, or any more) and comes
    back within about a second; `get_with_deadline` is the blocking form the stage runtime uses.
    """

    #: The config dataclass for this connector's `extra:` mapping.
    config_class: ClassVar[type]
    #: Where this connector carries payloads, for `omni-mesh validate` and `/ready` ("host" or "network").
    scope: ClassVar[str] = "network"
    #: What this type holds beyond its process and how it is reclaimed (omni_mesh.connectors.lifecycle).
    lifecycle: ClassVar[type[Lifecycle]] = Lifecycle
    #: The stage this connector serves (vllm-omni's adapter reads it); from config key `stage_id`.
    stage_id: int | str | None = None

    def __init__(self, config: dict[str, Any] | None = None) -> None:
        self.config = parse_config(self.config_class, config, owner=type(self).__name__)
        # Not a config field: vllm-omni's orchestrator injects it and its adapter reads the attribute.
        raw_stage_id = (config or {}).get("stage_id") if isinstance(config, dict) else None
        self.stage_id = raw_stage_id if isinstance(raw_stage_id, (int, str)) else None
        self._waits = Waits()
        self._put_errors = PutErrors()

    @classmethod
    def validate_config(cls, config: dict[str, Any] | None) -> None:
        """Check a config without touching the backend (topology validation, which reports what has no
        effect itself)."""
        parse_config(cls.config_class, config, owner=cls.__name__, warn=False)

    def put(self, from_stage: str, to_stage: str, put_key: str, data: Any) -> tuple[bool, int, dict | None]:
        """Store data. Returns (success, serialized_size, metadata); (False, 0, None) on failure, its
        reason logged and kept for `put_error()` (vllm-omni's contract: a failed put never raises).

        Connectors implement `_put`, which raises on failure; or override `put` itself."""
        try:
            return self._put(from_stage, to_stage, put_key, data)
        except Exception as exc:  # the one place a failure becomes vllm-omni's return value
            self._count_put_error()
            self._put_errors.record(type(self).__name__, from_stage, to_stage, put_key, exc)
            return False, 0, None

    def _put(self, from_stage: str, to_stage: str, put_key: str, data: Any) -> tuple[bool, int, dict | None]:
        raise NotImplementedError(f"{type(self).__name__} implements neither put() nor _put()")

    def _count_put_error(self) -> None:  # noqa: B027 - optional: connectors with an error counter count it
        """Count a failed put in this connector's own health counters."""

    def get(
        self, from_stage: str, to_stage: str, get_key: str, metadata: dict | None = None
    ) -> tuple[Any, int] | None:
        """Non-blocking poll: (object, size), or None while the payload is not there (yet, or any more).

        `metadata` is what put() returned; it may be missing or partial, then the key (and the
        producer's host and port, where given) locate the payload. Real failures (a corrupt frame,
        a producer that refuses, a closed connector) raise ConnectorError.

        Connectors implement `_poll`, which may raise PayloadMissing for a payload not there; or
        override `get` itself."""
        try:
            return self._poll(from_stage, to_stage, get_key, metadata)
        except PayloadMissing:  # the one place "not there" becomes vllm-omni's None
            return None

    def _poll(
        self, from_stage: str, to_stage: str, get_key: str, metadata: dict | None
    ) -> tuple[Any, int] | None:
        raise NotImplementedError(f"{type(self).__name__} implements neither get() nor _poll()")

    def get_with_deadline(
        self, from_stage: str, to_stage: str, get_key: str, metadata: dict | None = None, *, deadline: float
    ) -> tuple[Any, int]:
        """Block until the payload is there or `time.monotonic() >= deadline`; then a ConnectorError
        naming connector, edge and key (PayloadMissing; GetAbandoned after `abandon_get`). Polls `get`
        with backoff (`waits`); backends that can wait natively override `_wait_once`."""
        return self._waits.poll(
            get_key,
            lambda: self._wait_once(from_stage, to_stage, get_key, metadata, deadline),
            deadline,
            self._where_get(from_stage, to_stage, get_key),
            f"not there by the deadline{self._where_from()}: never put, already consumed, cleaned up or expired, "
            "or its producer died or is unreachable",
        )

    def _wait_once(
        self, from_stage: str, to_stage: str, get_key: str, metadata: dict | None, deadline: float
    ) -> tuple[Any, int] | None:
        """One try of `get_with_deadline`: `get` by default; may wait up to `deadline` where the
        backend can wait natively."""
        return self.get(from_stage, to_stage, get_key, metadata)

    def _where_from(self) -> str:
        """Where the payload was looked for, for the deadline's error (" on worker HOST:PORT")."""
        return ""

    def _where_get(self, from_stage: str, to_stage: str, get_key: str) -> str:
        return f"{type(self).__name__}: get of key {get_key!r} on edge {from_stage}->{to_stage}"

    def abandon_get(self, key: str) -> None:
        """Stop waiting for `key`: a `get_with_deadline` blocked on it raises now. A transfer already
        under way is never cancelled (its memory is released when it ends)."""
        self._waits.abandon(key)

    def reap_consumed(self) -> None:  # noqa: B027 - optional: most connectors free consumed payloads at once
        """Release producer bookkeeping for payloads consumed elsewhere (connectors that learn of it
        late do it here; the others already have)."""

    def put_error(self, from_stage: str, to_stage: str, put_key: str) -> str | None:
        """Why the last put of this key on this edge returned False (once; None if it did not)."""
        kept = self._put_errors.pop(edge_key(from_stage, to_stage, put_key))
        return kept[0] if kept else None

    def put_failure(self, from_stage: str, to_stage: str, put_key: str) -> ConnectorError | None:
        """The typed error (errors.py) of the last failed put of this key on this edge, once, instead
        of its reason: what a caller acts on (ConnectorFull: try again later)."""
        kept = self._put_errors.pop(edge_key(from_stage, to_stage, put_key))
        return kept[1] if kept else None

    @staticmethod
    def serialize_obj(obj: Any) -> bytes:
        """`obj` as one self-contained frame (our codec: no pickle)."""
        from omni_mesh import codec

        return bytes(codec.encode(obj))

    @staticmethod
    def deserialize_obj(data: Any) -> Any:
        """The object `serialize_obj` made; bytes from another process are untrusted (no class is imported)."""
        from omni_mesh import codec

        # A read-only buffer (bytes) is copied once and decoded as views; a writable one the caller may
        # reuse, so every leaf is copied out of it.
        return codec.decode(data, copy=not memoryview(data).readonly)

    def empty(self, shape: tuple[int, ...] | list[int], dtype: Any) -> Any:
        """An uninitialized CPU torch.Tensor for an output to put. Connectors that keep memory of their
        own return one in it (a put of it then copies nothing); the rest, an ordinary tensor. The
        caller must not write into it after handing it to put()."""
        import torch  # not at import time: connector modules without tensors stay light

        return torch.empty(tuple(shape), dtype=dtype)

    def warm_up(self) -> None:  # noqa: B027 - an optional hook: most connectors need no warm-up
        """Prepare the producer side (allocate and fault in pools) so the first put pays nothing extra."""

    @abstractmethod
    def cleanup(self, key: str) -> None:
        """Release anything still held for key (abort, timeout)."""

    @abstractmethod
    def health(self) -> dict:
        """{"status": "healthy" | "degraded" | "unhealthy", ...counters}."""

    def _put_health(self) -> dict[str, int]:
        """The base's counters for `health()`: failed puts (each also logged)."""
        return {"put_failures": self._put_errors.failures}

    @abstractmethod
    def close(self) -> None:
        """Release everything; idempotent."""

    def __enter__(self) -> OmniConnectorBase:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def edge_key(from_stage: str, to_stage: str, key: str) -> str:
    """The name of one payload on one edge: two edges never collide on the same request key."""
    return f"{from_stage}->{to_stage}/{key}"
