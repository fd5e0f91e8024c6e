"""Gets whose answer is still on its way (ZmqConnector's side channel).

vllm-omni's `get` is a poll that gives up within about a second. A ZeroMQ GET carries the payload in
its answer, and the producer hands the payload over as it answers: a poll that stopped waiting and
closed its socket would lose a payload still in transit (a large one, a slow link). So a poll that
times out leaves its request's socket here, under the payload's edge key, and the next get of that
key waits on it instead of asking again, with the session its answer was sealed for (ZmqConnector).
`abandon_get` and `close` drop them (the payload goes with its socket); at most MAX are kept, the
oldest dropped first.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any

from omni_mesh.connectors.served.dealers import LateReply


class LateGets:
    """Late requests by edge key, each with the endpoint it was sent to and the session it offered."""

    MAX = 64

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._waiting: OrderedDict[str, tuple[str, LateReply, Any]] = OrderedDict()

    def keep(self, key: str, endpoint: str, late: LateReply, session: Any = None) -> None:
        with self._lock:
            dropped = [self._waiting.pop(key, (endpoint, None, None))[1]]
            self._waiting[key] = (endpoint, late, session)
            while len(self._waiting) > self.MAX:
                dropped.append(self._waiting.popitem(last=False)[1][1])
        _close(dropped)

    def take(self, key: str, endpoint: str) -> LateReply | None:
        """The late request for `key` to `endpoint`, now the caller's; None if there is none."""
        with self._lock:
            entry = self._waiting.pop(key, None)
        if entry is None:
            return None
        if entry[0] != endpoint:  # asked of another producer since: this answer is not wanted
            _close([entry[1]])
            return None
        return entry[1]

    def session(self, key: str, endpoint: str) -> Any:
        """The session kept with a late request for `key` to `endpoint` (the next get resumes it), or None."""
        with self._lock:
            entry = self._waiting.get(key)
        return entry[2] if entry is not None and entry[0] == endpoint else None

    def drop(self, get_key: str) -> None:
        """Drop the late requests of `get_key` on any edge (abandon_get names the key alone)."""
        suffix = "/" + get_key
        with self._lock:
            keys = [key for key in self._waiting if key.endswith(suffix)]
            dropped = [self._waiting.pop(key)[1] for key in keys]
        _close(dropped)

    def drop_all(self) -> None:
        with self._lock:
            dropped = [entry[1] for entry in self._waiting.values()]
            self._waiting.clear()
        _close(dropped)


def _close(lates: list[LateReply | None]) -> None:
    for late in lates:
        if late is not None:
            late.close()
