"""Blocking gets: polling with backoff until a deadline, and the waits `abandon_get` stops.

`get_with_deadline` polls a connector's one-try hook with growing pauses (1 ms doubling up to
POLL_MAX_S) and raises PayloadMissing past the deadline, or GetAbandoned once `abandon_get` was called
for the key after the wait began. Backends that can wait natively make each try wait themselves.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from omni_mesh.connectors.errors import GetAbandoned, PayloadMissing

Once = Callable[[], "tuple[Any, int] | None"]  # one try of a wait: the payload, or None while not there
#: Longest pause between two polls of `get_with_deadline` (the first ones come sooner).
POLL_MAX_S = 0.05
#: Abandon counts only matter while a wait runs: past this many keys the oldest half is dropped.
KEEP = 4096


class Waits:
    """Per key, how many times `abandon_get` was called: a wait that sees the count change stops."""

    def __init__(self, connector: str) -> None:
        self._connector = connector
        self._lock = threading.Lock()
        self._abandoned: dict[str, int] = {}

    def count(self, key: str) -> int:
        with self._lock:
            return self._abandoned.get(key, 0)

    def abandon(self, key: str) -> None:
        with self._lock:
            self._abandoned[key] = self._abandoned.get(key, 0) + 1
            if len(self._abandoned) > KEEP:
                for old in list(self._abandoned)[: KEEP // 2]:
                    del self._abandoned[old]

    def poll(self, edge: str, key: str, once: Once, deadline: float, looked: str = "") -> tuple[Any, int]:
        """Call `once` until it answers, the key is abandoned or `deadline` (time.monotonic) passes.
        `edge` is "from->to"; `looked` says where the payload was looked for (" on worker HOST:PORT")."""
        where = f"{self._connector}: get of key {key!r} on edge {edge}"
        pause = 0.001
        abandoned = self.count(key)
        while True:
            result = once()
            if result is not None:
                return result
            if self.count(key) != abandoned:
                raise GetAbandoned(f"{where}: abandoned (abandon_get) before it arrived")
            left = deadline - time.monotonic()
            if left <= 0:
                raise PayloadMissing(
                    f"{where}: not there by the deadline{looked}: never put, already consumed, cleaned up or "
                    "expired, or its producer died or is unreachable"
                )
            time.sleep(min(pause, left))
            pause = min(pause * 2, POLL_MAX_S)
