"""Pydantic's validation errors as TopologyError messages: who (a stage, a section), the key path,
what was expected and what the file holds, and the mapping and key at fault (`key_of`) so that the
loader adds the line.

Fields say what they expect with `expect("must be ...")`; a misspelled key (near a known one) and a
value not among a field's choices carry a "did you mean". Everything else reads from `_EXPECTED`.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterable
from typing import Any, TypeVar, get_args

from pydantic import BaseModel, ValidationError, WrapValidator
from pydantic.fields import FieldInfo
from pydantic_core import ErrorDetails, PydanticCustomError

from omni_mesh.topology.model import TopologyError

M = TypeVar("M", bound=BaseModel)

#: Pydantic's error types a field without its own `expect` is described by.
_EXPECTED = {
    "model_type": "must be a mapping",
    "model_attributes_type": "must be a mapping",
    "dict_type": "must be a mapping",
    "list_type": "must be a list",
    "string_type": "must be a string",
    "bool_type": "must be true or false",
    "int_type": "must be an integer",
    "int_parsing": "must be an integer",
    "float_type": "must be a number",
    "too_short": "must not be empty",
    "string_too_short": "must not be empty",
}
#: Errors about the kind of value (a mapping, a list), which name the kind they got.
_SHAPES = frozenset({"model_type", "model_attributes_type", "dict_type", "list_type"})
#: A `who` such as "openai" or "edges[0]" is a key path the error's path continues.
_SECTION = re.compile(r"^[\w.\[\]]+$")


def expect(phrase: str, choices: Iterable[str] = ()) -> WrapValidator:
    """A field's own phrase for a wrong value ("must be an integer >= 1"); with `choices` (a Literal's),
    the error names them and the nearest."""
    names = list(choices)

    def check(value: Any, handler: Any) -> Any:
        try:
            return handler(value)
        except ValidationError:
            raise PydanticCustomError("expected", phrase, {"phrase": phrase, "choices": names}) from None

    check.phrase = phrase  # type: ignore[attr-defined]  # read back by _phrase
    return WrapValidator(check)


def one_of(choices: Iterable[str]) -> WrapValidator:
    return expect("is not one of", choices)


def misspelled(key: str, meant: str, rule: str) -> PydanticCustomError:
    """The error of an open section's key that is a misspelling of a known one (schema.near_miss)."""
    return PydanticCustomError("misspelled_key", "misspelled", {"key": key, "meant": meant, "rule": rule})


def spelling_message(where: str, key: object, meant: str, rule: str) -> str:
    return f"{where}: unknown key {key!r}; did you mean {meant!r}? ({rule}, but not one this close to a known key)"


def validated(model: type[M], data: Any, who: str) -> M:
    """`data` as `model`, or a TopologyError about its first mistake, which `who` is (or holds)."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise topology_error(model, exc.errors()[0], data, who) from None


def topology_error(model: type[BaseModel], error: ErrorDetails, data: Any, who: str) -> TopologyError:
    path, key_of, held = _walk(data, error["loc"])
    kind, ctx, value = error["type"], error.get("ctx") or {}, error["input"]
    on_key = len(error["loc"]) > len(path) and error["loc"][len(path)] == "[key]"
    if on_key:  # a mapping's key is wrong, not its value
        value, path = path[-1], path[:-1]
    where = _where(who, path)
    if on_key:
        where = f"{where} key {value!r}"
    if kind == "misspelled_key":
        return TopologyError(
            spelling_message(where, ctx["key"], ctx["meant"], ctx["rule"]), key_of=(held, ctx["key"])
        )
    if kind == "extra_forbidden":
        return TopologyError(f"{_where(who, path[:-1])}: {_unknown_key(model, path)}", key_of=key_of)
    if kind == "missing":
        missing = error["loc"][len(path)]
        field = _field_at(model, error["loc"])
        phrase = _phrase(field)
        said = f"; it {phrase}" if phrase else f"; {field.description}" if field and field.description else ""
        if _SECTION.match(who):
            return TopologyError(f"{_where(who, [*path, missing])}: missing{said}", key_of=key_of)
        return TopologyError(f"{where} has no {missing}: key{said}", key_of=key_of)
    if ctx.get("choices"):
        close = difflib.get_close_matches(str(value), ctx["choices"], n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        return TopologyError(
            f"{where}: {value!r} {ctx['phrase']} {', '.join(ctx['choices'])}{hint}", key_of=key_of
        )
    phrase = ctx.get("phrase") or _EXPECTED.get(kind)
    if phrase is None:  # a check of the section's values together (a model validator), or one we do not word
        return TopologyError(f"{where}: {error['msg'][:1].lower()}{error['msg'][1:]}", key_of=key_of)
    separator = ":" if _SECTION.match(who) or not path else ""
    got = "" if on_key else f", got {type(value).__name__ if kind in _SHAPES else _shown(value)}"
    return TopologyError(f"{where}{separator} {phrase}{got}", key_of=key_of)


def _walk(data: Any, loc: tuple[int | str, ...]) -> tuple[list[int | str], tuple[object, object] | None, Any]:
    """The part of `loc` that is keys of `data` (the rest names union members and the like), the
    mapping and key it ends at, and the value there."""
    path: list[int | str] = []
    key_of = None
    for item in loc:
        if isinstance(data, dict) and item in data:
            key_of = (data, item)
        elif isinstance(data, list) and isinstance(item, int) and 0 <= item < len(data):
            pass  # an item of a list: the line is its key's
        else:
            break
        path.append(item)
        data = data[item]
    return path, key_of, data


def _where(who: str, path: list[int | str]) -> str:
    text = "".join(f"[{item}]" if isinstance(item, int) else f".{item}" for item in path).lstrip(".")
    if not text:
        return who
    if _SECTION.match(who):
        return f"{who}{text if text.startswith('[') else '.' + text}"
    return f"{who}: {text}"


def _shown(value: Any) -> str:
    return (
        f"{type(value).__name__}"
        if isinstance(value, (dict, list)) and len(repr(value)) > 80
        else repr(value)
    )


def _field_at(model: type[BaseModel], loc: tuple[int | str, ...]) -> FieldInfo | None:
    """The field at `loc` (through nested models only), or None."""
    field = None
    for item in loc:
        fields = getattr(model, "model_fields", {})
        if item not in fields:
            return None
        field = fields[item]
        model = _submodel(field.annotation)  # type: ignore[assignment]
    return field


def _phrase(field: FieldInfo | None) -> str | None:
    """The `expect` phrase of `field`, if it has one."""
    phrases = (
        [getattr(getattr(meta, "func", None), "phrase", None) for meta in field.metadata] if field else []
    )
    return next(filter(None, phrases), None)


def _unknown_key(model: type[BaseModel], path: list[int | str]) -> str:
    """ "unknown key 'x'; did you mean 'y'? (allowed: ...)" for a key a closed section does not have."""
    key = path[-1]
    for item in path[:-1]:  # the nested model that refused it
        field = getattr(model, "model_fields", {}).get(item)
        model = (_submodel(field.annotation) if field is not None else None) or model
    known = sorted(field.alias or name for name, field in model.model_fields.items())
    close = difflib.get_close_matches(str(key), known, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return f"unknown key {key!r}{hint} (the keys are {', '.join(known)})"


def _submodel(annotation: Any) -> type[BaseModel] | None:
    """The model an annotation holds (`X`, `X | None`, `Annotated[X, ...]`), if any."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    return next(filter(None, map(_submodel, get_args(annotation))), None)
