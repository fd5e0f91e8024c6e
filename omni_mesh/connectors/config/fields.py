"""The value types of connector config fields, with vllm-omni's ways of writing them declared on the
type: a number as a string ("50051", vllm-omni reads it with int()), a size with a unit ("256MiB").
They apply where `parse_config` validates a user's `extra:` (the FROM_FILE context); a config built in
code stays strict. vllm-omni's other names for a field are its `vllm_omni(...)` aliases."""

from __future__ import annotations

import dataclasses
import functools
import re
from typing import Annotated, Any, TypeVar

from pydantic import (
    AfterValidator,
    AliasChoices,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
)
from pydantic.dataclasses import dataclass as typed_dataclass
from pydantic.fields import FieldInfo
from pydantic_core import ArgsKwargs, ErrorDetails, PydanticCustomError

from omni_mesh.connectors.errors import ConnectorConfigError

C = TypeVar("C")

#: The config classes' model config. Strict: a value in code is of its field's type or an error (the
#: FROM_FILE readers below are the only conversions); built at first use, not import.
STRICT = ConfigDict(
    strict=True, extra="forbid", defer_build=True, validate_by_name=True, validate_by_alias=True
)
#: The validation context of a user's extra: mapping.
FROM_FILE = {"from_file": True}
_INT = re.compile(r"^\s*[+-]?\d+\s*$")
_FLOAT = re.compile(r"^\s*[+-]?(\d+\.\d*|\.\d+|\d+)([eE][+-]?\d+)?\s*$")
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(i?)B?\s*$", re.IGNORECASE)
_SIZE_EXAMPLE = "a size such as 268435456 or '256MiB'"


def parse_size(value: Any, *, what: str = "size") -> int:
    """Accept 1048576, "1MiB", "1 MB", "1.5GiB": binary and decimal units both mean powers of 1024."""
    if isinstance(value, bool):
        raise ConnectorConfigError(f"{what}: expected a size, got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ConnectorConfigError(f"{what}: must not be negative, got {value}")
        return value
    match = _SIZE.match(value) if isinstance(value, str) else None
    if match is None:
        raise ConnectorConfigError(f"{what}: expected {_SIZE_EXAMPLE}, got {value!r}")
    number, unit, _ = match.groups()
    return int(float(number) * 1024 ** "_KMGT".index(unit.upper() or "_"))


def _from_file(read: Any) -> BeforeValidator:
    """`read(text)` applied to a string value of a user's extra: (not to a config built in code)."""

    def before(value: Any, info: ValidationInfo) -> Any:
        if isinstance(value, str) and info.context and info.context.get("from_file"):
            return read(value)
        return value

    return BeforeValidator(before)


def _size_text(text: str) -> int:
    try:
        return parse_size(text)
    except ConnectorConfigError:
        raise PydanticCustomError("size", f"expected {_SIZE_EXAMPLE}") from None


def number(value: Any, kind: Any) -> Any:
    """`value` as the int or float `kind` where it is a string that writes one; else as it is."""
    if isinstance(value, str) and kind in (int, float) and (_INT if kind is int else _FLOAT).match(value):
        return kind(value)
    return value


Int = Annotated[int, _from_file(lambda text: number(text, int))]
Float = Annotated[float, _from_file(lambda text: number(text, float))]
_SIZE_READER = _from_file(_size_text)
#: Bytes: an integer >= 0, or a string with a unit in a user's file.
Size = Annotated[int, Field(ge=0), _SIZE_READER]
PositiveSize = Annotated[int, Field(gt=0), _SIZE_READER]
Positive = Annotated[Float, Field(gt=0)]
NonNegative = Annotated[Float, Field(ge=0)]
PositiveInt = Annotated[Int, Field(gt=0)]
NonNegativeInt = Annotated[Int, Field(ge=0)]
AtLeastOne = Annotated[Int, Field(ge=1)]


def _port(value: int) -> int:
    if not 0 <= value < 65536:
        raise PydanticCustomError("phrase", "must be 0 (any free port) or 1-65535")
    return value


Port = Annotated[Int, AfterValidator(_port)]


def vllm_omni(*names: str) -> FieldInfo:
    """vllm-omni's name(s) for the field: `extra:` may use either (parse_config refuses both when they disagree)."""
    return Field(validation_alias=AliasChoices(*names))


def fields_of(cls: Any) -> dict[str, FieldInfo]:
    """The fields of a config class (a plain dataclass's as its typed twin reads them)."""
    return dict(_typed(cls).__pydantic_fields__) if dataclasses.is_dataclass(cls) else {}


def aliases(cls: Any) -> dict[str, str]:
    """{vllm-omni's name: our field} for the config class `cls`."""
    found = {}
    for name, field in fields_of(cls).items():
        if isinstance(field.validation_alias, AliasChoices):
            found.update({str(alias): name for alias in field.validation_alias.choices if alias != name})
    return found


def is_size(cls: Any, name: str) -> bool:
    field = fields_of(cls).get(name)
    return field is not None and _SIZE_READER in field.metadata


def validate(cls: type[C], values: dict[str, Any], owner: str) -> C:
    """`cls` built from `values` (our names or vllm-omni's) as read from a file, or a ConnectorConfigError
    naming the key, what it expects and what it got."""
    typed = _typed(cls)
    config = typed.__new__(typed)
    try:  # what the dataclass's __init__ does, with the FROM_FILE context
        typed.__pydantic_validator__.validate_python(  # type: ignore[attr-defined]
            ArgsKwargs((), values), self_instance=config, context=FROM_FILE
        )
    except ValidationError as exc:
        raise _config_error(typed, exc.errors()[0], owner) from None
    if typed is cls:
        return config
    return cls(**{field.name: getattr(config, field.name) for field in dataclasses.fields(cls)})  # type: ignore[arg-type]


@functools.cache
def _typed(cls: Any) -> Any:
    """`cls`, or for a plain dataclass (a third-party connector's) a typed twin whose field types come
    from the defaults, sizes by name (`_size`, `_bytes`) as vllm-omni reads them."""
    if hasattr(cls, "__pydantic_validator__"):
        return cls
    kinds = {bool: bool, int: Int, float: Float, str: str}
    fields = []
    for field in dataclasses.fields(cls):
        default = field.default if field.default is not dataclasses.MISSING else None
        kind = kinds.get(type(default), Any)
        if kind is Int and field.name.endswith(("_size", "_bytes")):
            kind = Size
        fields.append((field.name, kind, dataclasses.field(default=default)))
    return typed_dataclass(dataclasses.make_dataclass(cls.__name__, fields), config=STRICT)


def _config_error(cls: Any, error: ErrorDetails, owner: str) -> ConnectorConfigError:
    key = str(error["loc"][0]) if error["loc"] else "?"
    value = error["input"]
    if error["type"] == "size":
        return ConnectorConfigError(f"{owner}: {key}: expected {_SIZE_EXAMPLE}, got {value!r}")
    ctx = error.get("ctx") or {}
    phrase = {
        "greater_than": "must be positive",
        "greater_than_equal": "must not be negative"
        if ctx.get("ge") == 0
        else f"must be at least {ctx.get('ge')}",
        "phrase": error["msg"],
        "literal_error": f"must be one of {ctx.get('expected')}",
    }.get(error["type"])
    if phrase is not None:
        return ConnectorConfigError(f"{owner}: {key} {phrase}, got {value!r}")
    field = fields_of(cls).get(aliases(cls).get(key, key))
    kind = getattr(field.annotation, "__name__", None) if field is not None else None
    if kind is None:
        return ConnectorConfigError(f"{owner}: config key {key!r}: {error['msg']}, got {value!r}")
    return ConnectorConfigError(f"{owner}: config key {key!r} expects {kind}, got {value!r}")
