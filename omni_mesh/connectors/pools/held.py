"""What a connector keeps on behalf of transfers: payloads a producer holds for its consumers (under
their edge key, in pool slots), and regions a consumer cannot reuse yet because a transfer that timed
out may still write there. Thread-safe bookkeeping only; the memory itself belongs to the connector.
"""

from __future__ import annotations

import collections
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from omni_mesh.connectors.errors import ConnectorError, PayloadMissing
from omni_mesh.connectors.keys import cleaned_by


@dataclass(eq=False)
class Held:
    """One payload a producer keeps for its consumer."""

    key: str  # edge key: from->to/put_key
    put_key: str
    token: str
    size: int
    offset: int | None  # pool offset; None when it lives in `buffer` (pool too full)
    buffer: Any = None
    touched: float = field(default_factory=time.monotonic)
    claimed: bool = False  # a consumer is reading it (pull connectors): only its release frees it
    sends: int = 0  # replies still being sent from it (ZmqConnector serves it until confirmed)
    released: bool = False  # let go of while a reply was still sent from it: its last send frees it
    regions: list[Any] = field(default_factory=list)  # empty() regions it is sent from (ZmqConnector)


class Gone(PayloadMissing):
    """A payload is not there (never put, consumed, cleaned up, expired, or stale metadata): a
    consumer's get() answers None for it, not an error."""


class HeldTable:
    """Payloads waiting for consumers, by edge key; expiry and request-prefix cleanup. Thread-safe.

    A claimed payload (a consumer is pulling it) that is cleaned up or replaced by a new put of the
    same key is retired, not freed: its slot is freed when the reader releases it or at expiry.
    With `expire_claimed=False` a claimed payload never expires: its reader is a local transfer with
    a deadline of its own, which must finish before the memory goes.
    """

    def __init__(
        self,
        ttl_s: float,
        *,
        expire_claimed: bool = True,
        on_replaced: Callable[[Held], None] | None = None,
        on_deferred: Callable[[Held], None] | None = None,
    ) -> None:
        self.ttl_s = ttl_s
        self._expire_claimed = expire_claimed
        self._items: dict[str, Held] = {}
        self._retired: dict[tuple[str, str], Held] = {}
        self._lock = threading.Lock()
        # Payloads stored later (`defer`), what frees one that a deferred payload replaces, and what
        # counts a deferred payload once stored (its put is counted there, off the put's path too).
        self._pending: collections.deque[tuple] = collections.deque()
        self._on_replaced = on_replaced
        self._on_deferred = on_deferred
        #: defer((make, *args)): store `make(*args)` later, as `add` would: the next call that reads
        #: the table makes and adds it (a consumer asks only once the put returned its metadata, so it
        #: always finds it). This keeps the payload's bookkeeping off the put's path; one it replaces
        #: goes to `on_replaced`. A deque's append: atomic, no lock, and no Python frame on that path.
        self.defer: Callable[[tuple], None] = self._pending.append

    def _drain(self) -> None:
        """Add the deferred payloads, in the order they were put."""
        if not self._pending:
            return
        stored, replaced = [], []
        with self._lock:
            while self._pending:
                make, *args = self._pending.popleft()
                held = make(*args)
                stored.append(held)
                old = self._add_locked(held)
                if old is not None:
                    replaced.append(old)
        for old in replaced:
            self._on_replaced(old)
        if self._on_deferred is not None:
            for held in stored:
                self._on_deferred(held)

    def gone(self) -> Gone:
        if self.ttl_s > 0:
            return Gone(f"no payload under this key: already consumed, cleaned up, or expired after ttl_s={self.ttl_s:g}")
        return Gone("no payload under this key: already consumed or cleaned up")

    def add(self, held: Held) -> Held | None:
        """Store `held`; returns the unclaimed payload it replaces (to be freed by the caller), if any."""
        self._drain()
        with self._lock:
            return self._add_locked(held)

    def _add_locked(self, held: Held) -> Held | None:
        old = self._items.pop(held.key, None)
        self._items[held.key] = held
        if old is not None and old.claimed:
            self._retired[(old.key, old.token)] = old
            return None
        return old

    def _find(self, key: str, token: str) -> Held:
        held = self._items.get(key)
        if held is None:
            raise self.gone()
        if token and not secrets.compare_digest(held.token, token):  # no token: a get by key alone
            raise Gone("token mismatch: the metadata belongs to another put of this key")
        return held

    def take(self, key: str, token: str) -> Held:
        """Remove and return the payload; Gone if it is not there."""
        self._drain()
        with self._lock:
            retired = self._retired.pop((key, token), None)
            if retired is not None:
                return retired
            found = self._find(key, token)
            del self._items[key]
            return found

    def claim(self, key: str, token: str, *, exclusive: bool = False) -> Held:
        """Mark the payload as being read: it stays until released (or expired). Gone if it is not
        there; with `exclusive`, ConnectorError if another reader has claimed it."""
        self._drain()
        with self._lock:
            found = self._find(key, token)
            if exclusive and found.claimed:
                raise ConnectorError("another consumer is reading this payload")
            found.claimed = True
            found.touched = time.monotonic()
            return found

    def unclaim(self, key: str, token: str) -> Held | None:
        """The reader gave up: the payload waits again, or, if it was retired meanwhile, is returned
        to be freed by the caller."""
        self._drain()
        with self._lock:
            retired = self._retired.pop((key, token), None)
            if retired is not None:
                return retired
            held = self._items.get(key)
            if held is not None and held.token == token:
                held.claimed = False
                held.touched = time.monotonic()
            return None

    def newest(self, prefix: str) -> Held | None:
        """The newest unclaimed payload whose key starts with `prefix` (a get by key alone)."""
        self._drain()
        with self._lock:
            found = [h for k, h in self._items.items() if k.startswith(prefix) and not h.claimed]
            return max(found, key=lambda held: held.touched, default=None)

    def pop_expired(self, now: float) -> list[Held]:
        if self.ttl_s <= 0:
            return []
        self._drain()
        with self._lock:
            stale = [key for key, held in self._items.items() if self._stale(held, now)]
            expired = [self._items.pop(key) for key in stale]
            stale_retired = [ref for ref, held in self._retired.items() if self._stale(held, now)]
            expired += [self._retired.pop(ref) for ref in stale_retired]
            return expired

    def _stale(self, held: Held, now: float) -> bool:
        return now - held.touched > self.ttl_s and (self._expire_claimed or not held.claimed)

    def pop_matching(self, key: str, *, retire_claimed: bool = True) -> list[Held]:
        """Unclaimed payloads whose put_key is `key` or starts with `key/` (claimed ones are retired,
        unless not `retire_claimed`: their owner frees them itself once their readers are done)."""
        self._drain()
        with self._lock:
            matching = [k for k, h in self._items.items() if cleaned_by(h.put_key, key)]
            freed = []
            for k in matching:
                held = self._items.pop(k)
                if held.claimed and retire_claimed:
                    self._retired[(held.key, held.token)] = held
                else:
                    freed.append(held)
            return freed

    def pop_all(self) -> list[Held]:
        self._drain()
        with self._lock:
            items = [*self._items.values(), *self._retired.values()]
            self._items.clear()
            self._retired.clear()
            return items

    def __len__(self) -> int:
        self._drain()
        with self._lock:
            return len(self._items) + len(self._retired)


class PendingReleases:
    """Releases that wait for something to finish, each run once its `done()` says so: memory a
    timed-out transfer may still write into, or a reply libzmq may still be sending from.
    Thread-safe; `reap()` from any thread."""

    def __init__(self) -> None:
        self._items: list[tuple[Callable[[], bool], Callable[[], None]]] = []
        self._lock = threading.Lock()

    def add(self, done: Callable[[], bool], release: Callable[[], None]) -> None:
        with self._lock:
            self._items.append((done, release))

    def reap(self) -> None:
        with self._lock:
            if not self._items:
                return
            finished, keep = [], []
            for item in self._items:
                (finished if item[0]() else keep).append(item)
            self._items = keep
        for _, release in finished:
            release()

    def release_all(self) -> None:
        with self._lock:
            items, self._items = self._items, []
        for _, release in items:
            release()

    def __len__(self) -> int:
        with self._lock:
            return len(self._items)
