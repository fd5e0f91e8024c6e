"""MooncakeStoreConnector's machinery: one store client, its registered local buffer and the keys this
process put.

    put   plan the frame with the codec, lay it straight into a region of the local buffer and
          `upsert_from` it under the store key (the store copies it into a segment, so the region is
          free again when the call returns).
    get   look the key up once (None if it is not there), `get_into` a region of the local buffer,
          remove the key, and decode tensors as views over the region; the region goes back when the
          last view is garbage-collected (or copy them out: `copy_on_get`).

Keys nobody consumes are removed `ttl_s` after their put by a reaper thread. The master is probed with
a plain TCP connect before the store client starts, because the client's own retry loop blocks for
about 90 s on an unreachable master. Every return code is mapped in `mooncake.errors`.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any

from omni_mesh import codec
from omni_mesh.connectors._addresses import resolve_host
from omni_mesh.connectors.config import MooncakeStoreConfig
from omni_mesh.connectors.counters import Counters
from omni_mesh.connectors.errors import ConnectorClosed, ConnectorError, ConnectorUnavailable
from omni_mesh.connectors.keys import cleaned_by
from omni_mesh.connectors.mooncake import errors
from omni_mesh.connectors.mooncake.loading import import_mooncake
from omni_mesh.connectors.mooncake.probes import MasterWatch, probe_metadata_server, probe_tcp
from omni_mesh.connectors.pools.registered import PoolErrors, RegisteredPool, pool_status

OWNER = "MooncakeStoreConnector"
# A get_into answering one of these read nothing: the key went away, or is larger than asked for.
_RETRY_READ = (errors.OBJECT_NOT_FOUND, errors.INVALID_PARAMS)


@dataclass
class _Owned:
    put_key: str
    expires: float


class StoreNode:
    """The store client, its local buffer and this process's keys (what MooncakeStoreConnector
    delegates to)."""

    def __init__(self, cfg: MooncakeStoreConfig) -> None:
        self.cfg = cfg
        store_module = import_mooncake("mooncake.store", OWNER)
        self.host = resolve_host(cfg.host)
        probe_tcp(
            cfg.master,
            cfg.master_connect_timeout_s,
            OWNER,
            "Mooncake master",
            "start `mooncake_master` there or fix `master` in the connector's extra",
        )
        probe_metadata_server(cfg.metadata_server, cfg.master_connect_timeout_s, OWNER)
        self._master = MasterWatch(cfg.master, OWNER, min(0.5, cfg.master_connect_timeout_s))
        self._lock = threading.Lock()
        self._closed = False
        self._stop = threading.Event()
        self._owned: dict[str, _Owned] = {}  # store key -> what this process put and nobody removed yet
        self.counters = Counters("puts", "gets", "bytes_put", "bytes_got", "errors", "expired", "cleaned")
        self._replicate = store_module.ReplicateConfig()
        self._replicate.replica_num = cfg.replica_num
        self._store = store_module.MooncakeDistributedStore()
        # The store's own staging buffer serves only its bytes API, which this connector never uses.
        rc = self._store.setup(
            self.host, cfg.metadata_server, cfg.segment, 0, cfg.protocol, cfg.device_name, cfg.master
        )
        if rc != 0:
            self._store = None
            raise ConnectorUnavailable(
                f"{OWNER}: the store client did not start (rc={rc}, host={self.host}, master={cfg.master}, "
                f"metadata_server={cfg.metadata_server!r}, segment={cfg.segment}); check the master's log"
            )
        pool_errors = PoolErrors(
            OWNER,
            "localbuf",
            "tensors returned from get()",
            "drop them sooner, raise localbuf, or set copy_on_get: true",
            self.error,
        )
        self._pool: RegisteredPool | None = RegisteredPool(
            cfg.localbuf, prefault=cfg.prefault, errors=pool_errors
        )
        rc = self._store.register_buffer(self._pool.address, self._pool.size)
        if rc != 0:
            self._shutdown_store()
            raise errors.store_error(
                rc,
                f"{OWNER}: registering the {cfg.localbuf}-byte local buffer (lower localbuf or check the RDMA "
                "device's memory-lock limit, ulimit -l)",
            )
        self._reaper = threading.Thread(target=self._reap_loop, name="omni-mesh-store-reaper", daemon=True)
        self._reaper.start()

    def error(self) -> None:
        self.counters.add("errors")

    # ------------------------------------------------------------------ put and get

    def put(self, key: str, put_key: str, data: Any, where: str) -> tuple[int, dict]:
        store, pool = self._open(f"put of {where}")
        frame = codec.plan(data)
        size = frame.nbytes
        offset = pool.reserve(size, self.cfg.pool_wait_s, f"put of {where}")
        try:
            frame.write_into(pool.array, offset)
            # upsert: a repeated put of one key replaces the payload (a plain put keeps the first one).
            rc = store.upsert_from(key, pool.address + offset, size, self._replicate)
        finally:
            pool.free(offset)
        if rc != 0:
            raise self._store_error(rc, f"put of {where} ({size} bytes)")
        with self._lock:
            self._owned[key] = _Owned(put_key, time.monotonic() + self.cfg.ttl_s)
        self.counters.add_many(puts=1, bytes_put=size)
        return size, {"key": key, "length": size}

    def get(self, key: str, metadata: Any, where: str) -> tuple[Any, int] | None:
        store, pool = self._open(f"get of {where}")
        if not isinstance(metadata, dict):
            metadata = None  # none, or not put()'s: the key alone locates the payload
        if metadata is not None and metadata.get("key", key) != key:
            raise ConnectorError(f"{OWNER}: metadata for {where} was made for another payload: {metadata!r}")
        hint = metadata.get("length") if isinstance(metadata, dict) else None
        fetched = self._fetch(store, pool, key, hint if type(hint) is int and hint > 0 else None, where)
        if fetched is None:
            return None
        offset, length = fetched
        store.remove(key, True)  # force: our own read holds a lease on it
        with self._lock:
            self._owned.pop(key, None)  # producer and consumer may be this instance
        data = pool.decode(offset, length, where, copy=self.cfg.copy_on_get)
        self.counters.add_many(gets=1, bytes_got=length)
        return data, length

    def _fetch(
        self, store: Any, pool: RegisteredPool, key: str, length: int | None, where: str
    ) -> tuple[int, int] | None:
        """get_into a fresh region: (offset, length), or None when the key is not in the store. With
        the length from the metadata the first try skips asking the master for the size."""
        asked = length is None
        if length is None:
            length = self._size_of(store, key, where)
        while length is not None:
            offset = pool.reserve(length, self.cfg.pool_wait_s, f"get of {where}")
            try:
                got = store.get_into(key, pool.address + offset, length)
            except BaseException:
                pool.free(offset)
                raise
            if got == length:
                return offset, length
            pool.free(offset)
            if got not in _RETRY_READ:
                self.counters.add("errors")
                if got >= 0:
                    raise ConnectorError(
                        f"{OWNER}: get of {where} read {got} of {length} bytes (store key {key!r})"
                    )
                raise self._store_error(got, f"{OWNER}: get of {where} (store key {key!r})")
            if asked:  # removed between the size and the read: consumed by another getter
                return None
            length, asked = self._size_of(store, key, where), True
        return None

    def _size_of(self, store: Any, key: str, where: str) -> int | None:
        """The payload's size in the store, or None when the key is not there (yet, or any more)."""
        size = store.get_size(key)
        if size > 0:
            return size
        if size not in (0, errors.OBJECT_NOT_FOUND):
            self.counters.add("errors")
            raise self._store_error(size, f"{OWNER}: get of {where}: the size of store key {key!r}")
        return None

    # ------------------------------------------------------------------ reclaim and lifecycle

    def _reap_loop(self) -> None:
        tick = min(1.0, self.cfg.ttl_s / 4)
        while not self._stop.wait(tick):
            now = time.monotonic()
            with self._lock:
                expired = [key for key, owned in self._owned.items() if owned.expires <= now]
            if expired:
                self._remove(expired)
                self.counters.add("expired", len(expired))

    def _remove(self, keys: list[str]) -> None:
        with self._lock:
            for key in keys:
                self._owned.pop(key, None)
            store = self._store
        if store is not None and keys:
            store.batch_remove(keys, True)  # not-found (consumed meanwhile) is fine

    def reap_consumed(self) -> None:
        with self._lock:
            keys, store = list(self._owned), self._store
        if not keys or store is None or self._closed:
            return
        found = store.batch_is_exist(keys)  # 1 there, 0 gone, negative: unknown (kept)
        with self._lock:
            for key, there in zip(keys, found, strict=False):
                if there == 0:
                    self._owned.pop(key, None)

    def cleanup(self, key: str) -> None:
        with self._lock:
            doomed = [k for k, o in self._owned.items() if cleaned_by(o.put_key, key)]
        self._remove(doomed)
        if doomed:
            self.counters.add("cleaned", len(doomed))

    def _open(self, what: str) -> tuple[Any, RegisteredPool]:
        store, pool = self._store, self._pool
        if self._closed or store is None or pool is None:
            raise ConnectorClosed(f"{OWNER} is closed ({what})")
        self._master.check(f"{OWNER}: {what}")
        return store, pool

    def _store_error(self, rc: int, what: str) -> ConnectorError:
        self._master.failed(rc)
        return errors.store_error(rc, what)

    def health(self) -> dict:
        counters = self.counters.snapshot()
        with self._lock:
            pending = len(self._owned)
        status, in_use, size = pool_status(self._pool, up=not self._closed and self._reaper.is_alive())
        return {
            "status": status,
            **counters,
            "tracked_keys": pending,
            "localbuf_size": size,
            "localbuf_in_use": in_use,
            "master": self.cfg.master,
            "segment": self.cfg.segment,
            "protocol": self.cfg.protocol,
        }

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            leftovers = list(self._owned)
        self._stop.set()
        self._reaper.join()
        self._remove(leftovers)
        self._shutdown_store()

    def _shutdown_store(self) -> None:
        store, pool = self._store, self._pool
        self._store = self._pool = None
        if store is not None and pool is not None:
            store.unregister_buffer(pool.address)
        if pool is not None:
            pool.close()  # views handed out by get() keep their memory until they die
        if store is not None:
            store.close()  # takes 1-2 s with a mounted segment
