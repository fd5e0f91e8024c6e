"""The connector contract: how a payload crosses one edge of the stage graph.

A connector is built from the `extra:` mapping of a topology's connector entry. The producer side
calls `put` and sends the returned metadata (small, msgpack-serialisable) over the control plane; the
consumer side, in another process and possibly on another host, builds a connector from the same
config and calls `get` with that metadata. Implementations are blocking: asyncio code calls them
through `asyncio.to_thread` (or an executor) and never on the event loop.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import threading
import time
from abc import ABC, abstractmethod
from typing import Any, ClassVar, TypeVar

from omni_mesh.connector_values import coerce_numbers, expand_env, numeric_fields
from omni_mesh.connectors import _vllm_omni_keys as vllm_omni_keys
from omni_mesh.connectors.errors import ConnectorError, ConnectorFull  # their home; imported from here too

C = TypeVar("C")

log = logging.getLogger("omni_mesh.connectors")

#: Longest pause between two polls of `get_with_deadline` (the first ones come sooner).
POLL_MAX_S = 0.05

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(i?)B?\s*$", re.IGNORECASE)


class ConnectorConfigError(ValueError):
    """The `extra:` mapping of a connector is wrong; the message names the connector and the key."""


def parse_size(value: Any, *, what: str = "size") -> int:
    """Accept 1048576, "1MiB", "1 MB", "1.5GiB": binary and decimal units both mean powers of 1024."""
    if isinstance(value, bool):
        raise ConnectorConfigError(f"{what}: expected a size, got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ConnectorConfigError(f"{what}: must not be negative, got {value}")
        return value
    if isinstance(value, str):
        match = _SIZE.match(value)
        if match:
            number, unit, _ = match.groups()
            return int(float(number) * 1024 ** "_KMGT".index(unit.upper() or "_"))
    raise ConnectorConfigError(f"{what}: expected a size such as 268435456 or '256MiB', got {value!r}")


def parse_config(cls: type[C], raw: dict[str, Any] | None, *, owner: str, warn: bool = True) -> C:
    """Build the config dataclass `cls` from a user's `extra:` mapping; the one place configs are read.

    In order: `$VAR`/`${VAR}` expand from the environment; vllm-omni's names for our keys are read as
    ours, and its keys that change nothing here are dropped with one warning each
    (`_vllm_omni_keys`); a key neither knows is an error naming it, with a "did you mean"; numeric
    strings become numbers where a number is meant; sizes (`_size`/`_bytes` names, or fields with
    `metadata=SIZE`) accept "256MiB"; values are checked against the field's default type; and
    then the dataclass's own `check(owner)` checks the values together. `warn=False` leaves the
    no-effect warnings to the caller (topology validation lists them itself).
    """
    fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    # read_extra's two steps, with vllm-omni's names made ours in between (so "60" for
    # buffer_ttl_seconds is read as the float ttl_s is).
    values = coerce_numbers(_ours(owner, expand_env(dict(raw or {})), fields, warn), numeric_fields(cls))
    for name, value in values.items():
        field = fields[name]
        # A size by its name unless the field says otherwise (MORI's post_batch_size is a count).
        if field.metadata.get("size", name.endswith(("_size", "_bytes"))):
            values[name] = parse_size(value, what=f"{owner}: {name}")
            continue
        default = field.default if field.default is not dataclasses.MISSING else None
        if default is not None and value is not None and not _same_kind(default, value):
            raise ConnectorConfigError(
                f"{owner}: config key {name!r} expects {type(default).__name__}, got {value!r}"
            )
        values[name] = float(value) if isinstance(default, float) else value
    config = cls(**values)
    check = getattr(config, "check", None)
    if check is not None:
        check(owner)
    return config


#: `field(metadata=SIZE)`: the field is a size in bytes whatever its name ("512MiB" accepted).
SIZE = {"size": True}


def _ours(owner: str, raw: dict[str, Any], fields: dict[str, Any], warn: bool) -> dict[str, Any]:
    """`raw` under our field names: vllm-omni's aliases renamed, its no-effect keys dropped (warned)."""
    values: dict[str, Any] = {}
    aliased: dict[str, str] = {}
    for key, value in raw.items():
        if key in fields:
            values.setdefault(key, value)
            continue
        entry = vllm_omni_keys.lookup(owner, key)
        if entry is None:
            hint = vllm_omni_keys.did_you_mean(key, [*fields, *vllm_omni_keys.known_keys(owner)])
            raise ConnectorConfigError(
                f"{owner}: unknown config key {key!r} in extra; {hint}(allowed: {', '.join(sorted(fields))}; "
                f"vllm-omni's: {vllm_omni_keys.summary(owner)})"
            )
        if entry.kind == "alias":
            target = entry.target or key
            aliased[target] = key
            values[target] = value
        elif entry.kind == "honoured" and entry.same_as_ours and value not in entry.same_as_ours:
            choices = ", ".join(map(repr, entry.same_as_ours))
            raise ConnectorConfigError(f"{owner}: config key {key!r} must be one of {choices}, got {value!r}")
        elif warn:
            vllm_omni_keys.warn_no_effect(owner, key, value, entry)
    for target, alias in aliased.items():
        if target in raw and raw[target] != raw[alias]:
            raise ConnectorConfigError(
                f"{owner}: {alias!r} (vllm-omni's name for {target!r}) and {target!r} disagree "
                f"({raw[alias]!r} vs {raw[target]!r}); set only one"
            )
    return values


def _same_kind(default: Any, value: Any) -> bool:
    if isinstance(default, bool) or isinstance(value, bool):
        return isinstance(default, bool) and isinstance(value, bool)
    if isinstance(default, (int, float)):
        return isinstance(value, (int, float)) and (isinstance(default, float) or isinstance(value, int))
    return isinstance(value, type(default))


class Counters:
    """Counters for `health()`, exact under concurrency and lock-free on the hot path.

    Each thread adds into its own shard (a plain dict only it writes); `snapshot` sums the shards.
    """

    def __init__(self, *names: str) -> None:
        self._names = names
        self._lock = threading.Lock()
        self._shards: list[dict[str, int]] = []
        self._local = threading.local()

    def _shard(self) -> dict[str, int]:
        try:
            return self._local.shard
        except AttributeError:
            shard = dict.fromkeys(self._names, 0)
            with self._lock:
                self._shards.append(shard)
            self._local.shard = shard
            return shard

    def add(self, name: str, amount: int = 1) -> None:
        shard = self._shard()
        shard[name] = shard.get(name, 0) + amount

    def add_many(self, **amounts: int) -> None:
        shard = self._shard()
        for name, amount in amounts.items():
            shard[name] = shard.get(name, 0) + amount

    def add_pair(self, first: str, second: str, amount: int, also: str | None = None) -> None:
        """`first` += 1 and `second` += amount (and `also` += 1): a put or a get and its bytes."""
        shard = self._shard()
        shard[first] += 1
        shard[second] += amount
        if also is not None:
            shard[also] += 1

    def snapshot(self) -> dict[str, int]:
        totals = dict.fromkeys(self._names, 0)
        with self._lock:
            shards = list(self._shards)
        for shard in shards:
            for name, value in list(shard.items()):
                totals[name] = totals.get(name, 0) + value
        return totals


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
    #: The stage this connector serves (vllm-omni's adapter reads it); from config key `stage_id`.
    stage_id: int | str | None = None

    def __init__(self, config: dict[str, Any] | None = None) -> None:
        self.config = parse_config(self.config_class, config, owner=type(self).__name__)
        # Not a config field: vllm-omni's orchestrator injects it and its adapter reads the attribute.
        raw_stage_id = (config or {}).get("stage_id") if isinstance(config, dict) else None
        self.stage_id = raw_stage_id if isinstance(raw_stage_id, (int, str)) else None
        self._abandoned: dict[str, int] = {}  # get_key -> waits told to stop (abandon_get)
        self._waits_lock = threading.Lock()
        self._put_failures = 0
        self._put_errors: dict[str, ConnectorError] = {}

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
        except Exception as exc:
            self._count_put_error()
            return self._put_failed(from_stage, to_stage, put_key, exc)

    def _put(self, from_stage: str, to_stage: str, put_key: str, data: Any) -> tuple[bool, int, dict | None]:
        raise NotImplementedError(f"{type(self).__name__} implements neither put() nor _put()")

    def _count_put_error(self) -> None:  # noqa: B027 - optional: connectors with an error counter count it
        """Count a failed put in this connector's own health counters."""

    @abstractmethod
    def get(
        self, from_stage: str, to_stage: str, get_key: str, metadata: dict | None = None
    ) -> tuple[Any, int] | None:
        """Non-blocking poll: (object, size), or None while the payload is not there (yet, or any more).

        `metadata` is what put() returned; it may be missing or partial, then the key (and the
        producer's host and port, where given) locate the payload. Real failures (a corrupt frame,
        a producer that refuses, a closed connector) raise ConnectorError.
        """

    def get_with_deadline(
        self, from_stage: str, to_stage: str, get_key: str, metadata: dict | None = None, *, deadline: float
    ) -> tuple[Any, int]:
        """Block until the payload is there or `time.monotonic() >= deadline`; then a ConnectorError
        naming connector, edge and key. Polls `get` with backoff; backends that can wait natively
        override `_wait_once`."""
        pause = 0.001
        with self._waits_lock:
            abandoned = self._abandoned.get(get_key, 0)
        while True:
            result = self._wait_once(from_stage, to_stage, get_key, metadata, deadline)
            if result is not None:
                return result
            with self._waits_lock:
                if self._abandoned.get(get_key, 0) != abandoned:
                    raise ConnectorError(
                        f"{self._where_get(from_stage, to_stage, get_key)}: abandoned (abandon_get) before it arrived"
                    )
            left = deadline - time.monotonic()
            if left <= 0:
                raise ConnectorError(
                    f"{self._where_get(from_stage, to_stage, get_key)}: not there by the deadline{self._where_from()}: "
                    "never put, already consumed, cleaned up or expired, or its producer died or is unreachable"
                )
            time.sleep(min(pause, left))
            pause = min(pause * 2, POLL_MAX_S)

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
        with self._waits_lock:
            self._abandoned[key] = self._abandoned.get(key, 0) + 1
            if len(self._abandoned) > 4096:  # counts only matter while a wait runs: keep the newest
                for old in list(self._abandoned)[:2048]:
                    del self._abandoned[old]

    def reap_consumed(self) -> None:  # noqa: B027 - optional: most connectors free consumed payloads at once
        """Release producer bookkeeping for payloads consumed elsewhere (connectors that learn of it
        late do it here; the others already have)."""

    def _put_failed(self, from_stage: str, to_stage: str, put_key: str, cause: object) -> tuple[bool, int, None]:
        """The `(False, 0, None)` of a failed put, its reason in one log line, `put_failures` and
        `put_failure()`. The reason names connector, key and edge once: a cause that already starts
        with the connector's name is not prefixed again."""
        name = type(self).__name__
        said = str(cause).removeprefix(f"{name}: ")
        reason = f"{name}: put of key {put_key!r} on edge {from_stage}->{to_stage} failed: {said}"
        log.warning("%s", reason)
        failure = ConnectorFull(reason) if isinstance(cause, ConnectorFull) else ConnectorError(reason)
        with self._waits_lock:
            self._put_failures += 1
            self._put_errors[edge_key(from_stage, to_stage, put_key)] = failure
            if len(self._put_errors) > 256:  # reasons nobody asked for: keep the newest
                del self._put_errors[next(iter(self._put_errors))]
        return False, 0, None

    def put_error(self, from_stage: str, to_stage: str, put_key: str) -> str | None:
        """Why the last put of this key on this edge returned False (once; None if it did not)."""
        failure = self.put_failure(from_stage, to_stage, put_key)
        return None if failure is None else str(failure)

    def put_failure(self, from_stage: str, to_stage: str, put_key: str) -> ConnectorError | None:
        """put_error() as an exception to raise: ConnectorFull when the connector's memory was full
        (worth retrying later), else ConnectorError (once; None if the put did not fail)."""
        with self._waits_lock:
            return self._put_errors.pop(edge_key(from_stage, to_stage, put_key), None)

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
        return {"put_failures": self._put_failures}

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
