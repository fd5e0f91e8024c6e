"""The JSON Schema of a connector's `extra:` mapping, from its config class and vllm-omni's names for
its keys, as `parse_config` reads them: numbers may be written as strings ("50051"), sizes with units
("256MiB"), and any value as a `$VAR` the stage's environment fills in."""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from omni_mesh.connectors.config import vllm_omni_keys
from omni_mesh.connectors.config.fields import aliases, is_size

_VARIABLE = {"type": "string", "pattern": r"\$", "description": "a $VAR or ${VAR:-default}"}
_INT_TEXT = {"type": "string", "pattern": r"^\s*[+-]?\d+\s*$"}
_FLOAT_TEXT = {"type": "string", "pattern": r"^\s*[+-]?(\d+\.\d*|\.\d+|\d+)([eE][+-]?\d+)?\s*$"}
_SIZE_TEXT = {"type": "string", "pattern": r"(?i)^\s*\d+(\.\d+)?\s*[KMGT]?i?B?\s*$", "examples": ["256MiB"]}


def extra_schema(owner: str, config_class: type) -> dict[str, Any]:
    """The schema of `extra:` for the connector type `owner`, whose config dataclass is `config_class`."""
    properties = {
        field.name: _field_schema(field, is_size(config_class, field.name))
        for field in dataclasses.fields(config_class)
    }
    for alias, target in aliases(config_class).items():
        properties[alias] = {**properties[target], "description": f"vllm-omni's name for {target}"}
    patterns: dict[str, Any] = {}
    for key, entry in vllm_omni_keys.table_rows(owner).items():
        note = f"vllm-omni's key ({entry.kind}): {entry.note}".rstrip(": ")
        if key.endswith("*"):
            patterns[f"^{re.escape(key[:-1])}"] = {"description": note}
        elif key not in properties:
            properties[key] = {"description": note}
    return {
        "type": "object",
        "title": f"{owner} extra",
        "properties": properties,
        "patternProperties": patterns,
        "additionalProperties": False,
    }


def _field_schema(field: dataclasses.Field, size: bool) -> dict[str, Any]:
    default = field.default
    if isinstance(default, bool):
        typed: list[dict[str, Any]] = [{"type": "boolean"}]
    elif isinstance(default, int) and size:
        typed = [{"type": "integer", "minimum": 0}, _SIZE_TEXT]
    elif isinstance(default, int):
        typed = [{"type": "integer"}, _INT_TEXT]
    elif isinstance(default, float):
        typed = [{"type": "number"}, _FLOAT_TEXT]
    else:
        return {"type": "string", "default": default}
    return {"anyOf": [*typed, _VARIABLE], "default": default}
