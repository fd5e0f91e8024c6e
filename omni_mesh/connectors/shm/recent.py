"""The tiny payloads a SharedMemoryConnector put while no get by key was seen on the host (shm_wanted).

They travelled in their metadata only; once a get by key is seen, the ones put within the last
BACKFILL_S (at most RECENT_MAX of them) are copied into the pool, so that a consumer that asks by key
for a payload put just before still finds it. Those it never asks for are freed BACKFILL_S later:
most were consumed through their metadata already. A cleanup of a key before then keeps its payloads
from being copied in. Not thread-safe: the connector calls it under its lock.
"""

from __future__ import annotations

import time
from collections import deque

RECENT_MAX = 256  # memory bound: at most this many frames of at most inline_max_bytes each
BACKFILL_S = 30.0  # a get by key finds tiny payloads put this long before its first try (get_timeout_s)


# (from_stage, to_stage, put_key, frame, time.monotonic() of the put): a plain tuple, built per tiny put
Recent = tuple[str, str, str, bytes, float]


class RecentTiny:
    """The ring of recent tiny puts and the cleanups that cancel them (module docstring)."""

    def __init__(self) -> None:
        self._ring: deque[Recent] = deque(maxlen=RECENT_MAX)
        self._cleaned: dict[str, float] = {}  # put key -> time of its latest cleanup, oldest first

    def remember(self, from_stage: str, to_stage: str, put_key: str, frame: bytes) -> None:
        self._ring.append((from_stage, to_stage, put_key, frame, time.monotonic()))

    def cleaned(self, key: str) -> None:
        """`cleanup(key)`: payloads of `key` or `key/...` put before now are not copied in."""
        if not self._ring:
            return
        now = time.monotonic()
        cleaned = self._cleaned
        cleaned.pop(key, None)
        cleaned[key] = now  # to the end: the dict stays ordered by time
        horizon = now - BACKFILL_S
        while True:  # markers older than any put still to copy in are moot
            oldest = next(iter(cleaned))
            if cleaned[oldest] >= horizon:
                break
            del cleaned[oldest]

    def take(self) -> list[Recent]:
        """The payloads to copy in now (put within BACKFILL_S, not cleaned up since); forgets them all."""
        horizon = time.monotonic() - BACKFILL_S
        taken = [entry for entry in self._ring if entry[4] >= horizon and not self._cleaned_since(entry[2], entry[4])]
        self.clear()
        return taken

    def clear(self) -> None:
        self._ring.clear()
        self._cleaned.clear()

    def _cleaned_since(self, put_key: str, put_at: float) -> bool:
        if not self._cleaned:
            return False
        parts = put_key.split("/")
        for end in range(1, len(parts) + 1):  # cleanup(key) covers key and key/...
            at = self._cleaned.get("/".join(parts[:end]))
            if at is not None and at >= put_at:
                return True
        return False
