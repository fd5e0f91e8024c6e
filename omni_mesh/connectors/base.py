"""The connector contract: how a payload crosses one edge of the stage graph.

A connector is built from the `extra:` mapping of a topology's connector entry. The producer side
calls `put` and sends the returned metadata (small, msgpack-serialisable) over the control plane; the
consumer side, in another process and possibly on another host, builds a connector from the same
config and calls `get` with that metadata. Implementations are blocking: asyncio code calls them
through `asyncio.to_thread` (or an executor) and never on the event loop.
"""

from __future__ import annotations

import dataclasses
import re
import threading
from abc import ABC, abstractmethod
from typing import Any, ClassVar, TypeVar

from omni_mesh.connector_values import coerce_numbers, expand_env, numeric_fields
from omni_mesh.connectors import _vllm_omni_keys as vllm_omni_keys

C = TypeVar("C")

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(i?)B?\s*$", re.IGNORECASE)


class ConnectorError(RuntimeError):
    """A connector could not do what was asked; the message names the connector, edge and key."""


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
        if name.endswith(("_size", "_bytes")) or field.metadata.get("size"):
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
    """One connector instance per process and config; safe to call from several threads."""

    #: The config dataclass for this connector's `extra:` mapping.
    config_class: ClassVar[type]
    #: Where this connector carries payloads, for `omni-mesh validate` and `/ready` ("host" or "network").
    scope: ClassVar[str] = "network"

    def __init__(self, config: dict[str, Any] | None = None) -> None:
        self.config = parse_config(self.config_class, config, owner=type(self).__name__)

    @classmethod
    def validate_config(cls, config: dict[str, Any] | None) -> None:
        """Check a config without touching the backend (topology validation, which reports what has no
        effect itself)."""
        parse_config(cls.config_class, config, owner=cls.__name__, warn=False)

    @abstractmethod
    def put(self, from_stage: str, to_stage: str, put_key: str, data: Any) -> tuple[bool, int, dict | None]:
        """Store data. Returns (success, serialized_size, metadata)."""

    @abstractmethod
    def get(
        self, from_stage: str, to_stage: str, get_key: str, metadata: dict | None = None
    ) -> tuple[Any, int] | None:
        """Retrieve data put under get_key, using the metadata put() returned. Returns (object, size)."""

    def warm_up(self) -> None:  # noqa: B027 - an optional hook: most connectors need no warm-up
        """Prepare the producer side (allocate and fault in pools) so the first put pays nothing extra."""

    @abstractmethod
    def cleanup(self, key: str) -> None:
        """Release anything still held for key (abort, timeout)."""

    @abstractmethod
    def health(self) -> dict:
        """{"status": "healthy" | "degraded" | "unhealthy", ...counters}."""

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
