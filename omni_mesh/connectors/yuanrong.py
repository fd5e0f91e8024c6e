"""YuanrongConnector: payloads kept by an openYuanrong datasystem worker (KV API, `yr.datasystem`).

Install with `pip install 'omni-mesh[yuanrong]'`; start a worker with `dscli start -w --worker_address
HOST:PORT ...` on every host. The producer lays each frame straight into the worker's shared memory
(`KVClient.mcreate` + `write_into` + `mset_buffer`: one copy); the consumer reads it from a read-only
shared-memory buffer (`get_read_only_buffers`), decodes it with one copy, then deletes the key.

Keys are `<key_prefix>;<edge key>` with every character outside the datasystem's key charset
percent-escaped (`%XX`, injective), so `thinker->talker/req-1/0` becomes
`omni;thinker-%3Etalker%2Freq-1%2F0`; keys longer than the 255-character limit end in `#<sha256>`.
Unconsumed payloads are deleted by the worker after `ttl_s`, or by `cleanup(request_id)`.

The datasystem client holds the GIL while it blocks, so every call is kept short: `get` is one call
that does not wait (None when the key is not there); `get_with_deadline` polls with
`get_sub_timeout_ms` slices up to its deadline instead of one long wait.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from typing import Any

from omni_mesh.codec import FrameError, decode, plan
from omni_mesh.connectors.base import (
    ConnectorError,
    Counters,
    OmniConnectorBase,
    edge_key,
)
from omni_mesh.connectors.config import YuanrongConfig
from omni_mesh.connectors.datasystem.keys import (
    INSTALL_HINT,
    MAX_VALUE,
    WorkerError,
    client_log_dir,
    datasystem_key,
    first_line,
)
from omni_mesh.connectors.errors import ConnectorClosed

# Re-exported: the raw-datasystem bench and tests read them here (datasystem/ is private).
__all__ = ["INSTALL_HINT", "YuanrongConfig", "YuanrongConnector", "client_log_dir", "datasystem_key"]
_RECENT_ERROR_S = 60.0


class YuanrongConnector(OmniConnectorBase):
    """Payloads through an openYuanrong datasystem worker (module docstring)."""

    config_class = YuanrongConfig
    scope = "network"

    def __init__(self, config: dict[str, Any] | None = None) -> None:
        super().__init__(config)
        cfg: YuanrongConfig = self.config
        self.worker = f"{cfg.host}:{cfg.port}"
        client_log_dir()  # before the client library starts logging
        try:
            from yr.datasystem import KVClient, WriteMode
        except ImportError as exc:
            raise ConnectorError(
                f"YuanrongConnector: yr.datasystem is not available ({exc}); {INSTALL_HINT}"
            ) from exc
        self._write_mode = getattr(WriteMode, cfg.write_mode)
        started = time.monotonic()
        try:
            # A plain TCP probe first: a KVClient that failed to connect takes ~2 s to destroy,
            # holding the GIL, so an unreachable worker is reported without creating one.
            socket.create_connection((cfg.host, cfg.port), timeout=cfg.connect_timeout_ms / 1000).close()
        except OSError as exc:
            raise ConnectorError(
                self._unreachable(time.monotonic() - started, str(exc) or "timed out")
            ) from None
        client = KVClient(
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
            raise ConnectorError(self._unreachable(time.monotonic() - started, failure))
        self._client = client
        self._lock = threading.Lock()
        self._mine: dict[str, tuple[str, str, float]] = {}  # edge key -> (datasystem key, put_key, put at)
        self._last_error = -1e9
        self._counters = Counters("puts", "gets", "bytes_put", "bytes_got", "errors", "deleted")
        # Consumed keys are deleted by a background thread, in batches: one delete RPC (about 1 ms
        # here) for many keys, and none on the get path.
        self._consumed: list[str] = []
        self._taken: set[str] = set()  # consumed here, deletion pending: a second get must not see them
        self._consumed_ready = threading.Condition()
        self._deleter: threading.Thread | None = None

    def _unreachable(self, waited: float, reason: str) -> str:
        return (
            f"YuanrongConnector: cannot reach the datasystem worker at {self.worker} (after {waited:.1f}s: "
            f"{reason}); start one there with `dscli start -w --worker_address {self.worker} ...` or set "
            "host/port to a running worker"
        )

    def _key(self, from_stage: str, to_stage: str, key: str) -> tuple[str, str]:
        edge = edge_key(from_stage, to_stage, key)
        return edge, datasystem_key(self.config.key_prefix, edge)

    def _call(self, where: str, method: str, *args: Any) -> Any:
        """client.method(*args); a failure raises WorkerError with the client's message.

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
        raise WorkerError(failure)

    # ---------------------------------------------------------------- put

    def _count_put_error(self) -> None:
        self._error()

    def _put(self, from_stage: str, to_stage: str, put_key: str, data: Any) -> tuple[bool, int, dict | None]:
        where = f"YuanrongConnector: put {from_stage}->{to_stage} key {put_key!r}"
        if self._client is None:
            raise ConnectorClosed(f"{where}: the connector is closed")
        frame = plan(data)
        if frame.nbytes > MAX_VALUE:
            raise ConnectorError(
                f"{where}: {frame.nbytes} bytes exceed the datasystem's {MAX_VALUE}-byte value limit"
            )
        edge, ds_key = self._key(from_stage, to_stage, put_key)
        ttl = int(round(self.config.ttl_s))
        try:
            buffers = self._call(where, "mcreate", [ds_key], [frame.nbytes], self._write_mode, ttl)
            frame.write_into(buffers[0].MutableData())  # straight into the worker's shared memory
            self._call(where, "mset_buffer", buffers)
        except WorkerError as exc:
            raise ConnectorError(f"{where} ({frame.nbytes} bytes) on worker {self.worker}: {exc}") from None
        finally:
            buffers = None
        now = time.monotonic()
        with self._consumed_ready:
            self._taken.discard(ds_key)
        with self._lock:
            self._mine[edge] = (ds_key, put_key, now)
            self._forget_expired(now)
        self._counters.add("puts")
        self._counters.add("bytes_put", frame.nbytes)
        return True, frame.nbytes, {"key": ds_key, "size": frame.nbytes, "worker": self.worker}

    def _forget_expired(self, now: float) -> None:
        """Drop bookkeeping of keys the worker has expired by now (lock held)."""
        ttl = self.config.ttl_s
        if ttl > 0 and len(self._mine) > 256:
            for edge in [e for e, (_, _, at) in self._mine.items() if now - at > ttl]:
                del self._mine[edge]

    # ---------------------------------------------------------------- get

    def get(
        self,
        from_stage: str,
        to_stage: str,
        get_key: str,
        metadata: dict | None = None,
        *,
        timeout_s: float | None = None,
    ) -> tuple[Any, int] | None:
        """A poll (one short call to the worker): None while the key is not there. Works with
        metadata=None too (the key derives from edge and get_key). With `timeout_s` it waits that
        long instead, then raises."""
        if timeout_s is None:
            return self._get(from_stage, to_stage, get_key, metadata, time.monotonic(), poll=True)
        return self._get(from_stage, to_stage, get_key, metadata, time.monotonic() + timeout_s, poll=False)

    def _wait_once(
        self, from_stage: str, to_stage: str, get_key: str, metadata: dict | None, deadline: float
    ) -> tuple[Any, int] | None:
        # Waits in slices of a second at most, so abandon_get and the deadline are noticed in time.
        return self._get(from_stage, to_stage, get_key, metadata, min(deadline, time.monotonic() + 1.0), poll=True)

    def _where_from(self) -> str:
        return f" on datasystem worker {self.worker}"

    def _get(
        self, from_stage: str, to_stage: str, get_key: str, metadata: Any, deadline: float, *, poll: bool
    ) -> tuple[Any, int] | None:
        edge, ds_key = self._key(from_stage, to_stage, get_key)
        where = f"YuanrongConnector: get {from_stage}->{to_stage} key {get_key!r}"
        if isinstance(metadata, dict) and metadata.get("key", ds_key) != ds_key:
            raise ConnectorError(
                f"{where}: the metadata is for datasystem key {metadata['key']!r}, not {ds_key!r}"
            )
        if ds_key in self._taken:
            return None  # consumed here; its deletion is still on the way
        buffers = self._wait_for(ds_key, deadline, where, poll=poll)
        if buffers is None:
            return None
        try:
            view = buffers[0].immutable_data()
            size = len(view)
            # Nothing returned may point into the shared memory, which goes away with the key: the
            # codec copies a read-only frame once and decodes views over that copy.
            obj = decode(view, copy=not view.readonly)
        except FrameError as exc:
            self._error()
            raise ConnectorError(
                f"{where}: corrupt frame under {ds_key!r} on worker {self.worker}: {exc}"
            ) from None
        finally:
            view = buffers = None
        self._delete_later(ds_key)
        with self._lock:
            self._mine.pop(edge, None)
        self._counters.add("gets")
        self._counters.add("bytes_got", size)
        return obj, size

    def _wait_for(self, ds_key: str, deadline: float, where: str, *, poll: bool) -> list | None:
        sub_ms = self.config.get_sub_timeout_ms
        started = time.monotonic()
        while True:
            remaining_ms = int((deadline - time.monotonic()) * 1000)
            try:
                return self._call(where, "get_read_only_buffers", [ds_key], max(0, min(sub_ms, remaining_ms)))
            except WorkerError as exc:
                if "not found" not in str(exc).lower():
                    self._error()
                    raise ConnectorError(f"{where} ({ds_key!r}) from worker {self.worker}: {exc}") from None
            if time.monotonic() >= deadline:
                if poll:
                    return None
                self._error()
                raise ConnectorError(
                    f"{where}: datasystem key {ds_key!r} not on worker {self.worker} after "
                    f"{time.monotonic() - started:.3g}s; "
                    "it was never put, another consumer took it, or it expired (ttl_s)"
                )
            # The client held the GIL for that whole poll: give other threads as long before the next.
            time.sleep(min(sub_ms / 1000, max(0.0, deadline - time.monotonic())))

    def _delete_later(self, ds_key: str) -> None:
        with self._consumed_ready:
            self._taken.add(ds_key)
            self._consumed.append(ds_key)
            if self._deleter is None:
                self._deleter = threading.Thread(target=self._delete_consumed, name="yuanrong-delete", daemon=True)
                self._deleter.start()
            self._consumed_ready.notify()

    def _delete_consumed(self) -> None:
        while True:
            with self._consumed_ready:
                while not self._consumed and self._client is not None:
                    self._consumed_ready.wait()
                keys, self._consumed = self._consumed, []
            if not keys:
                return  # closed, nothing left
            with contextlib.suppress(ConnectorError):  # counted as an error by _delete
                self._delete(keys, f"YuanrongConnector: delete {len(keys)} consumed key(s)")

    def flush(self) -> None:
        """Delete every consumed key now (close does this too)."""
        with self._consumed_ready:
            keys, self._consumed = self._consumed, []
        if keys:
            self._delete(keys, f"YuanrongConnector: delete {len(keys)} consumed key(s)")

    def _delete(self, ds_keys: list[str], where: str) -> None:
        try:
            failed = self._call(where, "delete", ds_keys)
        except WorkerError as exc:
            self._error()
            raise ConnectorError(
                f"{where}: cannot delete {len(ds_keys)} key(s) on worker {self.worker}: {exc}"
            ) from None
        self._counters.add("deleted", len(ds_keys) - len(failed or []))
        with self._consumed_ready:
            self._taken.difference_update(ds_keys)

    # ---------------------------------------------------------------- lifecycle

    def reap_consumed(self) -> None:
        """Forget the keys this process put that a consumer elsewhere has taken (gone from the worker)."""
        with self._lock:
            mine = list(self._mine.items())
        if not mine or self._client is None:
            return
        try:
            there = self._call("YuanrongConnector: reap_consumed", "exist", [ds_key for _, (ds_key, _, _) in mine])
        except (WorkerError, ConnectorError):
            return  # the worker is unreachable or we are closing: nothing is forgotten
        with self._lock:
            for (edge, held), exists in zip(mine, there, strict=False):
                if not exists and self._mine.get(edge) == held:
                    del self._mine[edge]

    def cleanup(self, key: str) -> None:
        prefix = key + "/"
        with self._lock:
            edges = [
                e for e, (_, put_key, _) in self._mine.items() if put_key == key or put_key.startswith(prefix)
            ]
            ds_keys = [self._mine.pop(e)[0] for e in edges]
        if ds_keys and self._client is not None:
            self._delete(ds_keys, f"YuanrongConnector: cleanup {key!r}")

    def _error(self) -> None:
        self._counters.add("errors")
        self._last_error = time.monotonic()

    def health(self) -> dict:
        report: dict[str, Any] = {
            **self._counters.snapshot(), **self._put_health(), "worker": self.worker, "held": len(self._mine)
        }
        try:
            status = self._call("YuanrongConnector: health", "health_check")
            reachable, detail = status.is_ok(), status.to_string()
        except ConnectorError:
            return {"status": "unhealthy", **report, "error": "closed"}
        except WorkerError as exc:
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
