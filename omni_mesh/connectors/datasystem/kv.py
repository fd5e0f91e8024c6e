"""YuanrongConnector's machinery: one `KVClient` of a datasystem worker and the keys this process put.

The producer lays each frame straight into the worker's shared memory (`mcreate` + `write_into` +
`mset_buffer`: one copy); the consumer reads it from a read-only shared-memory buffer
(`get_read_only_buffers`), decodes it with one copy, and a background thread deletes consumed keys in
batches (one delete RPC for many keys, none on the get path).

The datasystem client holds the GIL while it blocks, so every call is kept short: a poll is one call
that does not wait; a wait polls in `get_sub_timeout_ms` slices up to its deadline. Every failure of a
client call is mapped to the connectors' exception family in `datasystem.errors`.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from typing import Any

from omni_mesh.codec import FrameError, decode, plan
from omni_mesh.connectors import backends
from omni_mesh.connectors.config import YuanrongConfig
from omni_mesh.connectors.counters import Counters
from omni_mesh.connectors.datasystem import errors
from omni_mesh.connectors.datasystem.errors import first_line
from omni_mesh.connectors.datasystem.keys import client_log_dir, datasystem_key
from omni_mesh.connectors.errors import ConnectorClosed, ConnectorError, PayloadMissing
from omni_mesh.connectors.keys import cleaned_by

OWNER = "YuanrongConnector"
_RECENT_ERROR_S = 60.0  # health() says "degraded" this long after an error


class KVNode:
    """The client, its calls and this process's keys (what YuanrongConnector delegates to)."""

    def __init__(self, cfg: YuanrongConfig) -> None:
        self.cfg = cfg
        self.worker = f"{cfg.host}:{cfg.port}"
        client_log_dir()  # before the client library starts logging
        try:
            datasystem = backends.load("yr.datasystem", OWNER)
        except ImportError as exc:
            raise errors.missing_library(OWNER, "yr.datasystem", exc) from exc
        self._write_mode = getattr(datasystem.WriteMode, cfg.write_mode)
        started = time.monotonic()
        try:
            # A plain TCP probe first: a KVClient that failed to connect takes ~2 s to destroy,
            # holding the GIL, so an unreachable worker is reported without creating one.
            socket.create_connection((cfg.host, cfg.port), timeout=cfg.connect_timeout_ms / 1000).close()
        except OSError as exc:
            raise errors.unreachable(
                OWNER, self.worker, time.monotonic() - started, str(exc) or "timed out"
            ) from None
        client = datasystem.KVClient(
            cfg.host,
            cfg.port,
            connect_timeout_ms=cfg.connect_timeout_ms,
            token=cfg.token,
            access_key=cfg.access_key,
            secret_key=cfg.secret_key,
            tenant_id=cfg.tenant_id,
            req_timeout_ms=cfg.req_timeout_ms,
        )
        try:
            client.init()
            failure = None
        except RuntimeError as exc:
            failure = first_line(exc)
        if failure is not None:
            del client  # destroyed here, not whenever the traceback is collected (see _call)
            raise errors.unreachable(OWNER, self.worker, time.monotonic() - started, failure)
        self._client = client
        self._lock = threading.Lock()
        self._mine: dict[str, tuple[str, str, float]] = {}  # edge key -> (datasystem key, put_key, put at)
        self._last_error = -1e9
        self.counters = Counters("puts", "gets", "bytes_put", "bytes_got", "errors", "deleted")
        self._consumed: list[str] = []
        self._taken: set[str] = set()  # consumed here, deletion pending: a second get must not see them
        self._consumed_ready = threading.Condition()
        self._deleter: threading.Thread | None = None

    def _call(self, where: str, method: str, *args: Any) -> Any:
        """client.method(*args); a failure raises the family's kind for it (`errors.worker_error`),
        its message prefixed by `where`.

        No frame of a raised exception may hold the client: a traceback kept alive until after the
        worker is gone would let the client's destructor run then, which blocks for seconds holding
        the GIL. So the client is only ever a local of this function, dropped before raising.
        """
        client = self._client
        if client is None:
            raise ConnectorClosed(f"{where}: the connector is closed")
        try:
            return getattr(client, method)(*args)
        except RuntimeError as exc:
            failure = first_line(exc)
        del client
        raise errors.worker_error(failure, f"{where} on worker {self.worker}")

    def error(self) -> None:
        self.counters.add("errors")
        self._last_error = time.monotonic()

    # ---------------------------------------------------------------- put

    def put(self, edge: str, put_key: str, data: Any, where: str) -> tuple[int, dict]:
        if self._client is None:
            raise ConnectorClosed(f"{where}: the connector is closed")
        frame = plan(data)
        if frame.nbytes > errors.MAX_VALUE:
            raise errors.too_large(where, frame.nbytes)
        ds_key = datasystem_key(self.cfg.key_prefix, edge)
        ttl = int(round(self.cfg.ttl_s))
        what = f"{where} ({frame.nbytes} bytes)"
        try:
            buffers = self._call(what, "mcreate", [ds_key], [frame.nbytes], self._write_mode, ttl)
            frame.write_into(buffers[0].MutableData())  # straight into the worker's shared memory
            self._call(what, "mset_buffer", buffers)
        finally:
            buffers = None
        now = time.monotonic()
        with self._consumed_ready:
            self._taken.discard(ds_key)
        with self._lock:
            self._mine[edge] = (ds_key, put_key, now)
            self._forget_expired(now)
        self.counters.add_many(puts=1, bytes_put=frame.nbytes)
        return frame.nbytes, {"key": ds_key, "size": frame.nbytes, "worker": self.worker}

    def _forget_expired(self, now: float) -> None:
        """Drop bookkeeping of keys the worker has expired by now (lock held)."""
        ttl = self.cfg.ttl_s
        if ttl > 0 and len(self._mine) > 256:
            for edge in [e for e, (_, _, at) in self._mine.items() if now - at > ttl]:
                del self._mine[edge]

    # ---------------------------------------------------------------- get

    def get(self, edge: str, metadata: Any, deadline: float, where: str) -> tuple[Any, int] | None:
        """The payload under `edge`, or None if it is not there by `deadline` (time.monotonic)."""
        ds_key = datasystem_key(self.cfg.key_prefix, edge)
        if isinstance(metadata, dict) and metadata.get("key", ds_key) != ds_key:
            raise ConnectorError(
                f"{where}: the metadata is for datasystem key {metadata['key']!r}, not {ds_key!r}"
            )
        if ds_key in self._taken:
            return None  # consumed here; its deletion is still on the way
        buffers = self._wait_for(ds_key, deadline, where)
        if buffers is None:
            return None
        try:
            view = buffers[0].immutable_data()
            size = len(view)
            # Nothing returned may point into the shared memory, which goes away with the key: the
            # codec copies a read-only frame once and decodes views over that copy.
            obj = decode(view, copy=not view.readonly)
        except FrameError as exc:
            self.error()
            raise ConnectorError(
                f"{where}: corrupt frame under {ds_key!r} on worker {self.worker}: {exc}"
            ) from None
        finally:
            view = buffers = None
        self._delete_later(ds_key)
        with self._lock:
            self._mine.pop(edge, None)
        self.counters.add_many(gets=1, bytes_got=size)
        return obj, size

    def _wait_for(self, ds_key: str, deadline: float, where: str) -> list | None:
        sub_ms = self.cfg.get_sub_timeout_ms
        while True:
            remaining_ms = int((deadline - time.monotonic()) * 1000)
            try:
                return self._call(
                    f"{where} ({ds_key!r})",
                    "get_read_only_buffers",
                    [ds_key],
                    max(0, min(sub_ms, remaining_ms)),
                )
            except PayloadMissing:
                pass  # not there (yet): polled again until the deadline
            except ConnectorError:
                self.error()
                raise
            if time.monotonic() >= deadline:
                return None
            # The client held the GIL for that whole poll: give other threads as long before the next.
            time.sleep(min(sub_ms / 1000, max(0.0, deadline - time.monotonic())))

    # ---------------------------------------------------------------- deletes

    def _delete_later(self, ds_key: str) -> None:
        with self._consumed_ready:
            self._taken.add(ds_key)
            self._consumed.append(ds_key)
            if self._deleter is None:
                self._deleter = threading.Thread(
                    target=self._delete_consumed, name="yuanrong-delete", daemon=True
                )
                self._deleter.start()
            self._consumed_ready.notify()

    def _delete_consumed(self) -> None:
        while True:
            with self._consumed_ready:
                while not self._consumed and self._client is not None:
                    self._consumed_ready.wait()
                if not self._consumed:
                    return  # closed, nothing left
            with contextlib.suppress(ConnectorError):  # counted as an error by delete
                self.flush()

    def flush(self) -> None:
        """Delete every consumed key now."""
        with self._consumed_ready:
            keys, self._consumed = self._consumed, []
        if keys:
            self.delete(keys, f"{OWNER}: delete {len(keys)} consumed key(s)")

    def delete(self, ds_keys: list[str], where: str) -> None:
        try:
            failed = self._call(f"{where}: cannot delete {len(ds_keys)} key(s)", "delete", ds_keys)
        except ConnectorError:
            self.error()
            raise
        self.counters.add("deleted", len(ds_keys) - len(failed or []))
        with self._consumed_ready:
            self._taken.difference_update(ds_keys)

    # ---------------------------------------------------------------- lifecycle

    def reap_consumed(self) -> None:
        with self._lock:
            mine = list(self._mine.items())
        if not mine or self._client is None:
            return
        try:
            there = self._call(f"{OWNER}: reap_consumed", "exist", [ds_key for _, (ds_key, _, _) in mine])
        except ConnectorError:
            return  # the worker is unreachable or we are closing: nothing is forgotten
        with self._lock:
            for (edge, held), exists in zip(mine, there, strict=False):
                if not exists and self._mine.get(edge) == held:
                    del self._mine[edge]

    def cleanup(self, key: str) -> None:
        with self._lock:
            edges = [e for e, (_, put_key, _) in self._mine.items() if cleaned_by(put_key, key)]
            ds_keys = [self._mine.pop(e)[0] for e in edges]
        if ds_keys and self._client is not None:
            self.delete(ds_keys, f"{OWNER}: cleanup {key!r}")

    def health(self) -> dict:
        report: dict[str, Any] = {**self.counters.snapshot(), "worker": self.worker, "held": len(self._mine)}
        try:
            status = self._call(f"{OWNER}: health", "health_check")
            reachable, detail = status.is_ok(), status.to_string()
        except ConnectorClosed:
            return {"status": "unhealthy", **report, "error": "closed"}
        except ConnectorError as exc:
            reachable, detail = False, str(exc)
        if not reachable:
            return {"status": "unhealthy", **report, "error": f"worker {self.worker}: {detail}"}
        degraded = time.monotonic() - self._last_error < _RECENT_ERROR_S
        return {"status": "degraded" if degraded else "healthy", **report}

    def close(self) -> None:
        """Idempotent. The client disconnects as it is destroyed here; if the worker is already gone
        that takes the datasystem client several seconds."""
        if self._client is not None:
            with contextlib.suppress(ConnectorError):
                self.flush()
        with self._consumed_ready:
            with self._lock:
                self._client = None
            self._consumed_ready.notify()
        if self._deleter is not None:
            self._deleter.join(timeout=10)
