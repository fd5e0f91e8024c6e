"""The body of `POST /v1/requests`, and the check that its values can travel to a stage.

`inputs` and `params` go to the stages inside msgpack control messages. JSON can carry values msgpack
cannot (a lone surrogate in a string, an integer outside [-2**63, 2**64)): found only at dispatch,
they would fail the request midway. They are refused up front instead, naming the first such field.
"""

from __future__ import annotations

import math
from typing import Annotated, Any

import msgpack
from pydantic import BaseModel, ConfigDict, Field, StrictBool, field_validator
from pydantic_core import PydanticCustomError

from omni_mesh.coordinator.http.envelope import field_path


class RequestBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    inputs: dict[str, Any] = Field(default_factory=dict, description="the entry stages' inputs")
    params: dict[str, Any] = Field(default_factory=dict, description="passed to every handler as ctx.params")
    timeout_s: Annotated[float, Field(gt=0, allow_inf_nan=False, strict=True)] | None = Field(
        default=None, description="deadline in seconds (a finite number > 0); the coordinator's default if unset"
    )
    stream: StrictBool = Field(default=False, description="answer with server-sent events as the final stage streams")

    @field_validator("timeout_s", mode="before")
    @classmethod
    def _finite_positive_seconds(cls, value: Any) -> Any:
        # Python's json reads NaN and Infinity, and pydantic would read `true` as 1 s: only a real,
        # finite, positive number is a deadline.
        if value is None:
            return value
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if not number or not math.isfinite(value) or value <= 0:
            raise PydanticCustomError("timeout_s", "must be a finite number of seconds > 0, e.g. 30")
        return value


#: msgpack's default nesting limit: its packer refuses a value with more containers inside one another.
NEST_LIMIT = 1024
_INT_RANGE = (-(2**63), 2**64)


def unpackable(inputs: dict[str, Any], params: dict[str, Any]) -> tuple[str, str] | None:
    """None when `inputs` and `params` pack as the control message that carries them to a stage
    does; else (field, reason) for the first value, in msgpack's order, that does not."""
    whole = {"inputs": inputs, "params": params}
    try:
        # The call control.pack makes for every message (it takes whole typed messages, not values).
        msgpack.packb(whole, use_bin_type=True)
    except Exception as exc:  # OverflowError, UnicodeEncodeError, ValueError (depth), TypeError
        error = exc
    else:
        return None
    for name, section in whole.items():
        found = _first_culprit(name, section)
        if found is not None:
            return field_path(found[0]), found[1]
    return "inputs", f"cannot be passed on to the stages ({type(error).__name__}: {error})"


def _first_culprit(name: str, value: Any) -> tuple[tuple[str | int, ...], str] | None:
    """One pass over `value` in msgpack's order (keys before their values), with a stack rather
    than recursion (it may nest deep). Each leaf is checked once: packing subtree after subtree on
    the way down would cost depth x size, which a hostile 16 MiB body could make minutes."""
    # (where, value, nesting level: the message map is 1, `inputs` 2; is_key)
    stack: list[tuple[tuple[str | int, ...], Any, int, bool]] = [((name,), value, 2, False)]
    while stack:
        loc, value, level, is_key = stack.pop()
        if isinstance(value, (dict, list, tuple)):
            if level > NEST_LIMIT:
                return loc, f"nested more than {NEST_LIMIT} levels deep (with the message around it); flatten it"
            pairs = value.items() if isinstance(value, dict) else enumerate(value)
            for key, child in reversed(list(pairs)):
                stack.append(((*loc, key), child, level + 1, False))
                if isinstance(value, dict):
                    stack.append(((*loc, key), key, level + 1, True))
            continue
        problem = _leaf_problem(value)
        if problem is not None:
            return loc, f"the name of this field is {problem}" if is_key else problem
    return None


def _leaf_problem(value: Any) -> str | None:
    if value is None or isinstance(value, (bool, float)):
        return None
    if isinstance(value, int):
        low, high = _INT_RANGE
        if low <= value < high:
            return None
        return "an integer out of range; integers must lie in [-2**63, 2**64 - 1] (send larger ones as strings)"
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            code = ord(exc.object[exc.start])
            return f"not valid Unicode: a lone surrogate (\\u{code:04x}) at character {exc.start}; send UTF-8 text"
        return None
    try:  # not from JSON: let msgpack judge
        msgpack.packb(value, use_bin_type=True)
    except Exception as exc:
        return f"a value that cannot be passed on to the stages ({type(exc).__name__})"
    return None
