"""Values in a connector's `extra:` as vllm-omni's files write them.

vllm-omni's connectors expand `$VAR`, `${VAR}` and `${VAR:-default}` from the environment (a variable
that is not set stays as written) and read ports and sizes with `int(...)`, so `"50051"` is a port.
`read_extra` is the rule, applied by `parse_config` to every connector config (so also to a config
given straight to `create_connector`) and by the topology when it loads a file, in every process that
loads it: a stage on another host expands the variables of its own environment.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Mapping
from typing import Any

__all__ = ["coerce_numbers", "expand_env", "numeric_fields", "read_extra", "unset_variables"]

_VARIABLE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}|\$([A-Za-z_][A-Za-z0-9_]*)")
_INT = re.compile(r"^[+-]?\d+$")
_FLOAT = re.compile(r"^[+-]?(\d+\.\d*|\.\d+|\d+)([eE][+-]?\d+)?$")
# Keys vllm-omni reads with int() whatever the connector: ports and sizes (Mooncake's segment and
# localbuf are sizes in bytes).
_SIZE_KEYS = frozenset({"segment", "localbuf"})


def read_extra(extra: dict[str, Any], config_class: Any = None) -> dict[str, Any]:
    """`extra` as vllm-omni reads it: variables expanded, then numeric strings read as numbers where
    a number is meant (ports, sizes and `config_class`'s numeric fields)."""
    return coerce_numbers(expand_env(extra), numeric_fields(config_class))


def expand_env(value: Any, environ: Mapping[str, str] | None = None) -> Any:
    """`value` with variables expanded in every string, also inside nested mappings and lists."""
    env = os.environ if environ is None else environ
    if isinstance(value, str):
        return _VARIABLE.sub(lambda match: _replacement(match, env), value)
    if isinstance(value, dict):
        return {key: expand_env(item, env) for key, item in value.items()}
    if isinstance(value, list):
        return [expand_env(item, env) for item in value]
    return value


def _replacement(match: re.Match[str], env: Mapping[str, str]) -> str:
    braced, default, bare = match.groups()
    name = braced or bare
    if name in env:
        return env[name]
    return default if default is not None else match.group(0)


def unset_variables(value: Any) -> list[str]:
    """Names of the variables still written in `value` after expand_env (not set, no default)."""
    if isinstance(value, str):
        return [match.group(1) or match.group(3) for match in _VARIABLE.finditer(value)]
    if isinstance(value, dict):
        return [name for item in value.values() for name in unset_variables(item)]
    if isinstance(value, list):
        return [name for item in value for name in unset_variables(item)]
    return []


def numeric_fields(config_class: Any) -> dict[str, type]:
    """{field: int or float} for the numeric fields of a connector's config dataclass."""
    if not dataclasses.is_dataclass(config_class):
        return {}
    kinds: dict[str, type] = {}
    for field in dataclasses.fields(config_class):
        default = field.default
        if isinstance(default, (int, float)) and not isinstance(default, bool):
            kinds[field.name] = type(default)
    return kinds


def coerce_numbers(extra: dict[str, Any], numeric: Mapping[str, type] | None = None) -> dict[str, Any]:
    """`extra` with numeric strings turned into numbers where a number is meant: ports and sizes
    (by their names, as vllm-omni reads them) and the connector's own numeric fields (`numeric`)."""
    numeric = numeric or {}
    coerced = dict(extra)
    for key, value in extra.items():
        if not isinstance(value, str) or not isinstance(key, str):
            continue
        text = value.strip()
        if _is_port_or_size(key) or numeric.get(key) is int:
            if _INT.match(text):
                coerced[key] = int(text)
        elif numeric.get(key) is float and _FLOAT.match(text):
            coerced[key] = float(text)
    return coerced


def _is_port_or_size(key: str) -> bool:
    return key == "port" or key.endswith(("_port", "_size", "_bytes")) or key in _SIZE_KEYS
