"""The connector contract: vllm-omni's `OmniConnectorBase` and our lifecycle. Calls block. Failures raise
(errors.py); `put` and `get` alone turn them into vllm-omni's return values. Helpers: waits, put_errors."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar

from omni_mesh.connectors import serialization
from omni_mesh.connectors.config.parse import parse_config
from omni_mesh.connectors.errors import ConnectorError, PayloadMissing
from omni_mesh.connectors.lifecycle import Lifecycle
from omni_mesh.connectors.put_errors import PutErrors
from omni_mesh.connectors.waits import Waits

Stored = tuple[int, dict | None]  # a stored payload: (serialized size, metadata)
Got = tuple[Any, int]  # a payload got: (object, serialized size)


class OmniConnectorBase(ABC):
    """One per process and config; thread-safe. Implement `_put`, `_poll`, `cleanup`, `health`, `close`."""

    config_class: ClassVar[type]  # the dataclass its `extra:` mapping is read into
    scope: ClassVar[str] = "network"  # where it carries payloads: "host" or "network"
    lifecycle: ClassVar[type[Lifecycle]] = Lifecycle  # what it holds beyond its process (lifecycle.py)
    stage_id: int | str | None = None  # the stage it serves (config key `stage_id`; vllm-omni reads it)
    _where_from = ""  # where a get looks for payloads, for the deadline's error (" on worker HOST:PORT")
    serialize_obj = staticmethod(serialization.serialize_obj)
    deserialize_obj = staticmethod(serialization.deserialize_obj)

    def __init__(self, config: dict[str, Any] | None = None) -> None:
        self.config = parse_config(self.config_class, config, owner=type(self).__name__)
        raw_stage_id = config.get("stage_id") if isinstance(config, dict) else None  # vllm-omni injects it
        self.stage_id = raw_stage_id if isinstance(raw_stage_id, (int, str)) else None
        self._waits = Waits(type(self).__name__)
        self._put_errors = PutErrors(type(self).__name__)

    @classmethod
    def validate_config(cls, config: dict[str, Any] | None) -> None:  # without touching the backend
        parse_config(cls.config_class, config, owner=cls.__name__, warn=False)

    def put(self, from_stage: str, to_stage: str, put_key: str, data: Any) -> tuple[bool, int, dict | None]:
        """vllm-omni's put: (True, size, metadata), or (False, 0, None) as put_or_raise failed."""
        try:
            return (True, *self.put_or_raise(from_stage, to_stage, put_key, data))
        except ConnectorError:
            return False, 0, None

    def put_or_raise(self, from_stage: str, to_stage: str, put_key: str, data: Any) -> Stored:
        """(size, metadata), or a ConnectorError naming connector, edge and key (logged and counted)."""
        try:
            return self._put(from_stage, to_stage, put_key, data)
        except Exception as exc:
            self._count_put_error()
            raise self._put_errors.record(from_stage, to_stage, put_key, exc) from exc

    def _put(self, from_stage: str, to_stage: str, put_key: str, data: Any) -> Stored:
        if type(self).put is OmniConnectorBase.put:  # else it was written to vllm-omni's contract: put()
            raise NotImplementedError(f"{type(self).__name__} implements neither put() nor _put()")
        ok, size, metadata = self.put(from_stage, to_stage, put_key, data)
        if not ok:
            raise ConnectorError("put() returned False and said no more")
        return size, metadata

    def _count_put_error(self) -> None: ...  # noqa: B027 - optional: for connectors with an error counter

    def get(self, from_stage: str, to_stage: str, get_key: str, metadata: dict | None = None) -> Got | None:
        """Non-blocking poll: (object, size), or None while it is not there (yet, or any more)."""
        try:
            return self._poll(from_stage, to_stage, get_key, metadata)
        except PayloadMissing:  # the one place "not there" becomes vllm-omni's None
            return None

    def _poll(self, from_stage: str, to_stage: str, get_key: str, metadata: dict | None) -> Got | None:
        raise NotImplementedError(f"{type(self).__name__} implements neither get() nor _poll()")

    def get_with_deadline(
        self, from_stage: str, to_stage: str, get_key: str, metadata: dict | None = None, *, deadline: float
    ) -> Got:
        """Block until it is there; PayloadMissing past `deadline` (monotonic), GetAbandoned on abandon_get."""
        once = lambda: self._wait_once(from_stage, to_stage, get_key, metadata, deadline)  # noqa: E731
        return self._waits.poll(f"{from_stage}->{to_stage}", get_key, once, deadline, self._where_from)

    def _wait_once(
        self, from_stage: str, to_stage: str, get_key: str, metadata: dict | None, deadline: float
    ) -> Any:
        return self.get(from_stage, to_stage, get_key, metadata)  # backends that can wait natively do

    def abandon_get(self, key: str) -> None:
        """Stop waiting for `key` (a blocked `get_with_deadline` raises); never cancels a transfer."""
        self._waits.abandon(key)

    def reap_consumed(self) -> None: ...  # noqa: B027 - release what consumers elsewhere took (where late)

    def empty(self, shape: tuple[int, ...] | list[int], dtype: Any) -> Any:
        """An uninitialized CPU tensor, in the connector's memory where it keeps some (a put copies nothing)."""
        return serialization.plain_empty(shape, dtype)

    def warm_up(self) -> None: ...  # noqa: B027 - optional: prepare so the first put pays nothing extra

    @abstractmethod
    def cleanup(self, key: str) -> None:
        """Release anything still held for key (abort, timeout)."""

    @abstractmethod
    def health(self) -> dict:
        """{"status": "healthy" | "degraded" | "unhealthy", ...counters}; `_put_health()` among them."""

    def _put_health(self) -> dict[str, int]:  # for health(): failed puts (each also logged)
        return {"put_failures": self._put_errors.failures}

    @abstractmethod
    def close(self) -> None:
        """Release everything; idempotent."""

    def __enter__(self) -> OmniConnectorBase:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
