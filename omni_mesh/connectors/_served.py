"""`ServedConnector`: what ZmqConnector and the transfer-engine connectors share.

A producer keeps each payload in a slot of its memory pool (`SlotPool`, `HeldTable`) until a consumer
asks for it over the ZeroMQ side channel (a `RouterServer`, started by the first put), `ttl_s` passes
or `cleanup()` drops it. A consumer asks producers through a `DealerPool`. With the mesh's keys the
side channel runs CURVE both ways (`_channel_guard`). Subclasses decide how the
bytes move (in the reply itself, or pulled by a transfer engine) and which requests the server answers.

Config fields every subclass has: host, its side-channel port (`port_field`), memory_pool_size,
ttl_s, get_timeout_s; each config's `check()` checks them with `_checks.check_served`.
"""

from __future__ import annotations

import secrets
import threading
import time
from abc import abstractmethod
from typing import Any, ClassVar

import zmq

from omni_mesh.connectors._addresses import bind_and_advertise, tcp_endpoint
from omni_mesh.connectors._channel_guard import side_channel_keys
from omni_mesh.connectors._dealers import ChannelClosed, DealerPool
from omni_mesh.connectors._held import Held, HeldTable, SlotPool
from omni_mesh.connectors._zmq_channel import OK, Handler, RouterServer, frame_text
from omni_mesh.connectors.base import ConnectorError, Counters, OmniConnectorBase, edge_key

_RECENT_ERROR_S = 60.0  # health() reports "degraded" this long after an error


class ServedConnector(OmniConnectorBase):
    """Producer-held payloads served over a ZeroMQ side channel (module docstring)."""

    #: The config field holding the side channel's port (0: any free port).
    port_field: ClassVar[str] = "port"
    #: The metadata fields get() needs from put().
    metadata_fields: ClassVar[tuple[str, ...]] = ("endpoint",)
    #: The counters health() reports.
    counter_names: ClassVar[tuple[str, ...]] = ("puts", "gets", "bytes_put", "bytes_got", "errors", "expired")

    def __init__(self, config: dict[str, Any] | None = None) -> None:
        super().__init__(config)
        cfg = self.config
        self._name = type(self).__name__
        self._bind_host, self.host = bind_and_advertise(cfg.host)
        self._keys = side_channel_keys(self._name)  # CURVE on the side channel, or None (warned once)
        self._open_backend()  # raises ConnectorError naming what is missing
        self._closed = False
        self._slots = SlotPool(cfg.memory_pool_size)
        self._held = HeldTable(cfg.ttl_s)
        self._ctx = zmq.Context()
        self._dealers = DealerPool(self._ctx, self._keys)
        self._server: RouterServer | None = None
        self.endpoint: str | None = None
        self._lock = threading.Lock()
        self._last_error = -1e9
        self._counters = Counters(*self.counter_names)

    # ---- hooks

    def _open_backend(self) -> None:  # noqa: B027 - optional: most subclasses have no backend to open
        """Import and start whatever moves the bytes; raise ConnectorError naming what is missing."""

    @abstractmethod
    def _serving_handlers(self) -> dict[bytes, Handler]:
        """Prepare to serve (once, under the lock, on the first put); the requests the server answers."""

    def _close_backend(self) -> None:  # noqa: B027 - optional: most subclasses have nothing more to close
        """Release what `_open_backend` and serving made; the server and the channel are closed already."""

    # ---- producer side

    def _start_server(self) -> None:
        with self._lock:
            if self._closed:
                raise ConnectorError(f"{self._name}: the connector is closed")
            if self._server is not None:
                return
            port = getattr(self.config, self.port_field)
            server = RouterServer(
                self._ctx,
                self._bind_host,
                port,
                self._serving_handlers(),
                self._expire,
                self._name,
                keys=self._keys,
                port_name=self.port_field,
            )
            port = server.start()
            self._server = server
            self.endpoint = tcp_endpoint(self.host, port)

    def _hold(self, key: str, put_key: str, size: int, offset: int | None, buffer: Any = None) -> Held:
        """Keep a payload for its consumer (replacing an earlier put of the key) and count the put."""
        held = Held(key, put_key, secrets.token_hex(8), size, offset, buffer)
        replaced = self._held.add(held)
        if replaced is not None:
            self._release(replaced)
        self._counters.add_many(puts=1, bytes_put=size)
        return held

    def _release(self, held: Held) -> None:
        if held.offset is not None:
            self._slots.free(held.offset)
        held.buffer = None

    def _expire(self) -> None:
        for held in self._held.pop_expired(time.monotonic()):
            self._release(held)
            self._counters.add("expired")

    def cleanup(self, key: str) -> None:
        for held in self._held.pop_matching(key):
            self._release(held)

    # ---- consumer side

    def get(
        self,
        from_stage: str,
        to_stage: str,
        get_key: str,
        metadata: dict | None = None,
        *,
        timeout_s: float | None = None,
    ) -> tuple[Any, int] | None:
        """Fetch and decode the payload; `timeout_s` overrides get_timeout_s for this call."""
        key = edge_key(from_stage, to_stage, get_key)
        where = f"{self._name}: get {from_stage}->{to_stage} key {get_key!r}"
        needed = self.metadata_fields
        if (
            not isinstance(metadata, dict)
            or any(name not in metadata for name in needed)
            or not isinstance(metadata.get("endpoint"), str)
        ):
            raise ConnectorError(
                f"{where}: needs the metadata put() returned ({', '.join(needed)}), got {metadata!r}"
            )
        if metadata.get("key", key) != key:
            raise ConnectorError(f"{where}: the metadata is for {metadata['key']!r}, not this edge and key")
        if self._closed:
            raise ConnectorError(f"{where}: the connector is closed")
        endpoint = metadata["endpoint"]
        timeout = self.config.get_timeout_s if timeout_s is None else timeout_s
        obj, size = self._fetch(endpoint, key, metadata, timeout, f"{where} from {endpoint}")
        self._counters.add_many(gets=1, bytes_got=size)
        return obj, size

    @abstractmethod
    def _fetch(
        self, endpoint: str, key: str, metadata: dict, timeout_s: float, where: str
    ) -> tuple[Any, int]:
        """Bring the payload from the producer at `endpoint` and decode it: (object, size).

        Failures are ConnectorErrors starting with `where` (connector, edge, key and endpoint).
        """

    def _ask(
        self, endpoint: str, parts: list[bytes], timeout_s: float, where: str, late: str
    ) -> list[zmq.Frame]:
        """One side-channel request `[op, key, *args]`; the reply frames if the producer answered OK.

        Anything else is a ConnectorError starting with `where`; `late` says what no answer means.
        """
        try:
            reply = self._dealers.request(endpoint, parts, timeout_s)
        except TimeoutError:
            self._error()
            raise ConnectorError(f"{where}: {late}") from None
        except ChannelClosed:
            raise ConnectorError(f"{where}: the connector was closed") from None
        except zmq.ZMQError as exc:
            self._error()
            raise ConnectorError(f"{where}: {exc}") from None
        if len(reply) < 2 or reply[1].bytes != parts[1]:
            self._error()
            raise ConnectorError(f"{where}: malformed reply")
        if reply[0].bytes != OK:
            self._error()
            raise ConnectorError(f"{where}: {frame_text(reply[2]) if len(reply) > 2 else 'refused'}")
        return reply

    def _error(self) -> None:
        self._counters.add("errors")
        self._last_error = time.monotonic()

    # ---- lifecycle

    def health(self) -> dict:
        server = self._server
        if self._closed or (server is not None and not server.alive):
            status = "unhealthy"
        elif time.monotonic() - self._last_error < _RECENT_ERROR_S:
            status = "degraded"
        else:
            status = "healthy"
        report: dict[str, Any] = {"status": status, **self._counters.snapshot()}
        report.update(
            endpoint=self.endpoint,
            held=len(self._held),
            pool_bytes=self._slots.size,
            pool_used_bytes=self._slots.in_use,
            curve=self._keys is not None,
            refused_peers=server.guard.refused.count if server is not None else 0,
            malformed_requests=server.guard.malformed.count if server is not None else 0,
        )
        if server is not None and server.error is not None:
            report["error"] = f"server thread stopped: {server.error}"
        return report

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        if self._server is not None:
            self._server.stop()
        self._dealers.close()
        self._held.pop_all()
        self._ctx.term()  # blocks until in-flight get()s (woken with ETERM) have closed their sockets
        self._close_backend()
