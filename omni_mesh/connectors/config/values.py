"""Values in a connector's `extra:` as vllm-omni's files write them.

vllm-omni's connectors expand `$VAR`, `${VAR}` and `${VAR:-default}` from the environment (a variable
that is not set stays as written) and read ports and sizes with `int(...)`, so `"50051"` is a port.
`parse_config` expands the variables of every connector config (so also of a config given straight to
`create_connector`) and its fields' types read the numbers (config/fields.py); `read_extra` does both
for the topology when it loads a file, in every process that loads it: a stage on another host
expands the variables of its own environment.
"""

from __future__ import annotations

import os
import re
from typing import Any

from omni_mesh.connectors.config.fields import fields_of, number

__all__ = ["expand_env", "read_extra", "unset_variables"]

_VARIABLE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}|\$([A-Za-z_][A-Za-z0-9_]*)")
# Keys vllm-omni reads with int() whatever the connector: ports and sizes (Mooncake's segment and
# localbuf are sizes in bytes).
_SIZE_KEYS = frozenset({"segment", "localbuf"})


def read_extra(extra: dict[str, Any], config_class: Any = None) -> dict[str, Any]:
    """`extra` as vllm-omni reads it: variables expanded, then numeric strings read as numbers where
    a number is meant (ports, sizes and `config_class`'s numeric fields)."""
    kinds = {name: field.annotation for name, field in fields_of(config_class).items()}
    return {
        key: number(value, int if _is_port_or_size(key) else kinds.get(key))
        for key, value in expand_env(extra).items()
    }


def expand_env(value: Any) -> Any:
    """`value` with variables expanded in every string, also inside nested mappings and lists."""
    if isinstance(value, str):
        return _VARIABLE.sub(_replacement, value)
    if isinstance(value, dict):
        return {key: expand_env(item) for key, item in value.items()}
    if isinstance(value, list):
        return [expand_env(item) for item in value]
    return value


def _replacement(match: re.Match[str]) -> str:
    braced, default, bare = match.groups()
    name = braced or bare
    if name in os.environ:
        return os.environ[name]
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


def _is_port_or_size(key: object) -> bool:
    return isinstance(key, str) and (
        key == "port" or key.endswith(("_port", "_size", "_bytes")) or key in _SIZE_KEYS
    )
