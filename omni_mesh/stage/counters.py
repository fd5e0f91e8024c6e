"""A handler's own counters, carried to the coordinator in every heartbeat.

A handler may have the hook `counters() -> dict[str, int | float]` (omni_mesh.handlers.HandlerHooks):
cheap to call (it runs on the replica's event loop at every heartbeat), names in Prometheus' form with
the base unit and, for a count that only grows, `_total` (`encoder_cache_hits_total`, `queue_bytes`).
The coordinator shows them per replica in `/v1/stages` (`counters`) and exports each as
`omni_mesh_handler_<name>` (`/metrics`, labels `stage` and `replica`). A name or value that is not one is left out, with one
warning per name: a handler's mistake never stops the heartbeat that keeps its replica alive.
"""

from __future__ import annotations

import logging
import re
from typing import Any

from omni_mesh.handlers import HandlerHooks

log = logging.getLogger("omni_mesh.stage")

#: What a counter's name may be (Prometheus' metric-name characters, lower case).
NAME = re.compile(r"[a-z_][a-z0-9_]*")
_warned: set[str] = set()


def handler_counters(hooks: HandlerHooks, stage: str) -> dict[str, int | float]:
    """The handler's `counters()` checked: numbers under valid names ({} for a handler without counters)."""
    try:
        reported: Any = hooks.counters()
    except Exception as exc:  # noqa: BLE001 - the handler's bug; the heartbeat must go on
        _warn_once(f"{stage}:counters()", "stage %s: its handler's counters() failed: %r", stage, exc)
        return {}
    if not isinstance(reported, dict):
        _warn_once(f"{stage}:type", "stage %s: counters() returned %s, not a dict", stage, type(reported).__name__)
        return {}
    out: dict[str, int | float] = {}
    for name, value in reported.items():
        if isinstance(name, str) and NAME.fullmatch(name) and isinstance(value, int | float) and not isinstance(value, bool):
            out[name] = value
        else:
            _warn_once(f"{stage}:{name!r}", "stage %s: counter %r = %r left out (a lower-case metric name and a "
                       "number, please)", stage, name, value)
    return out


def _warn_once(key: str, message: str, *args: Any) -> None:
    if key not in _warned:
        _warned.add(key)
        log.warning(message, *args)
