"""Reading a connector's `extra:` mapping into its config class: the one place configs are read
(`OmniConnectorBase.__init__`, `validate_config`, and `omni-mesh validate` through `connector_type`)."""

from __future__ import annotations

import dataclasses
import re
from typing import Any, TypeVar

from omni_mesh.connectors.config import vllm_omni_keys
from omni_mesh.connectors.config.values import coerce_numbers, expand_env, numeric_fields
from omni_mesh.connectors.errors import ConnectorConfigError

C = TypeVar("C")

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(i?)B?\s*$", re.IGNORECASE)


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
    (`vllm_omni_keys`); a key neither knows is an error naming it, with a "did you mean"; numeric
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
        if is_size(field):
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


def is_size(field: dataclasses.Field) -> bool:
    """Whether a config field is a size in bytes: by its name unless the field says otherwise (MORI's
    post_batch_size is a count)."""
    return bool(field.metadata.get("size", field.name.endswith(("_size", "_bytes"))))


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
