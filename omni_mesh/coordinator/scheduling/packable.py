"""Whether a request's values can travel to a stage, and the path that names a field in an error.

`inputs` and `params` go to the stages inside msgpack control messages. JSON can carry values msgpack
cannot (a lone surrogate in a string, an integer outside [-2**63, 2**64)): found only at dispatch,
they would fail the request midway. Admission refuses them up front instead, naming the first such
field, for `POST /v1/requests` and the OpenAI route alike.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from typing import Any

import msgpack

_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_MAX_KEY_CHARS = 64  # a field name is echoed in the error: keep a huge one from bloating it

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


def field_path(loc: Iterable[str | int]) -> str:
    """`("inputs", "a", 3, "b")` -> `inputs.a[3].b`; odd keys are quoted with JSON escapes, so a
    name holding a lone surrogate or a control character still serialises (`inputs["\\ud800"]`)."""
    out = ""
    for part in loc:
        if isinstance(part, int) and not isinstance(part, bool):
            out += f"[{part}]"
            continue
        text = str(part)
        if len(text) > _MAX_KEY_CHARS:
            text = text[:_MAX_KEY_CHARS] + "..."
        if _IDENTIFIER.match(text):
            out += f".{text}" if out else text
        else:
            out += f"[{json.dumps(text, ensure_ascii=True)}]"
    return out
