"""Counters for a connector's `health()`, exact under concurrency and lock-free on the hot path."""

from __future__ import annotations

import threading


class Counters:
    """Exact under concurrency and lock-free on the hot path: each thread adds into its own shard (a
    plain dict only it writes); `snapshot` sums the shards."""

    def __init__(self, *names: str) -> None:
        self._names = names
        self._lock = threading.Lock()
        self._shards: list[dict[str, int]] = []
        self._local = threading.local()

    def _shard(self) -> dict[str, int]:
        try:
            return self._local.shard
        except AttributeError:
            shard = dict.fromkeys(self._names, 0)
            with self._lock:
                self._shards.append(shard)
            self._local.shard = shard
            return shard

    def add(self, name: str, amount: int = 1) -> None:
        shard = self._shard()
        shard[name] = shard.get(name, 0) + amount

    def add_many(self, **amounts: int) -> None:
        shard = self._shard()
        for name, amount in amounts.items():
            shard[name] = shard.get(name, 0) + amount

    def add_pair(self, first: str, second: str, amount: int, also: str | None = None) -> None:
        """`first` += 1 and `second` += amount (and `also` += 1): a put or a get and its bytes."""
        shard = self._shard()
        shard[first] += 1
        shard[second] += amount
        if also is not None:
            shard[also] += 1

    def snapshot(self) -> dict[str, int]:
        totals = dict.fromkeys(self._names, 0)
        with self._lock:
            shards = list(self._shards)
        for shard in shards:
            for name, value in list(shard.items()):
                totals[name] = totals.get(name, 0) + value
        return totals
