"""Reading a connector's `extra:` mapping into its config class: the one place configs are read
(`OmniConnectorBase.__init__`, `validate_config`, and `omni-mesh validate` through `connector_type`)."""

from __future__ import annotations

from typing import Any, TypeVar

from omni_mesh.connectors.config import vllm_omni_keys
from omni_mesh.connectors.config.fields import aliases, fields_of, parse_size, validate
from omni_mesh.connectors.config.values import expand_env
from omni_mesh.connectors.errors import ConnectorConfigError

__all__ = ["ConnectorConfigError", "parse_config", "parse_size"]

C = TypeVar("C")


def parse_config(cls: type[C], raw: dict[str, Any] | None, *, owner: str, warn: bool = True) -> C:
    """Build the config dataclass `cls` from a user's `extra:` mapping; the one place configs are read.

    In order: `$VAR`/`${VAR}` expand from the environment; vllm-omni's keys that change nothing here
    are dropped with one warning each (`vllm_omni_keys`); a key neither the class (its fields and
    their vllm-omni aliases) nor the table knows is an error naming it, with a "did you mean"; the
    fields' types read the values (numeric strings, sizes with units: config/fields.py); and then the
    dataclass's own `check(owner)` checks the values together. `warn=False` leaves the no-effect
    warnings to the caller (topology validation lists them itself).
    """
    config = validate(cls, _ours(owner, expand_env(dict(raw or {})), cls, warn), owner)
    check = getattr(config, "check", None)
    if check is not None:
        check(owner)
    return config


def _ours(owner: str, raw: dict[str, Any], cls: Any, warn: bool) -> dict[str, Any]:
    """`raw` less vllm-omni's keys that change nothing here (warned); one of a field's two names."""
    fields, renamed = fields_of(cls), aliases(cls)
    values: dict[str, Any] = {}
    for key, value in raw.items():
        if key in fields or key in renamed:
            values[key] = value
            continue
        entry = vllm_omni_keys.lookup(owner, key)
        if entry is None:
            hint = vllm_omni_keys.did_you_mean(key, [*fields, *renamed, *vllm_omni_keys.table_rows(owner)])
            theirs = ", ".join([*sorted(renamed), vllm_omni_keys.summary(owner)])
            raise ConnectorConfigError(
                f"{owner}: unknown config key {key!r} in extra; {hint}(allowed: {', '.join(sorted(fields))}; "
                f"vllm-omni's: {theirs})"
            )
        if entry.kind == "honoured" and entry.same_as_ours and value not in entry.same_as_ours:
            choices = ", ".join(map(repr, entry.same_as_ours))
            raise ConnectorConfigError(f"{owner}: config key {key!r} must be one of {choices}, got {value!r}")
        if warn:
            vllm_omni_keys.warn_no_effect(owner, key, value, entry)
    for alias, target in renamed.items():
        if alias in values and target in values:
            if values[alias] != values[target]:
                raise ConnectorConfigError(
                    f"{owner}: {alias!r} (vllm-omni's name for {target!r}) and {target!r} disagree "
                    f"({values[alias]!r} vs {values[target]!r}); set only one"
                )
            del values[alias]
    return values
