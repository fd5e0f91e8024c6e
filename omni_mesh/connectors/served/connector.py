"""`ServedConnector`: what ZmqConnector and the transfer-engine connectors share.

A producer keeps each payload in a slot of its memory pool (`SlotPool`, `HeldTable`) until a consumer
asks for it over the ZeroMQ side channel (a `RouterServer`, started by the first put), `ttl_s` passes
or `cleanup()` drops it. A consumer asks producers through a `DealerPool`. With the mesh's keys the
side channel runs CURVE both ways (`served.guard`). Subclasses decide how the
bytes move (in the reply itself, or pulled by a transfer engine) and which requests the server answers.

Config fields every subclass has: host, its side-channel port (`port_field`), memory_pool_size,
ttl_s, get_timeout_s; their types in config/classes.py (Port, Positive, NonNegative) check them.
"""

from __future__ import annotations

import itertools
import secrets
import threading
import time
from abc import abstractmethod
from typing import Any, ClassVar

import zmq

from omni_mesh.connectors._addresses import bind_and_advertise, tcp_endpoint
from omni_mesh.connectors.base import OmniConnectorBase
from omni_mesh.connectors.counters import Counters
from omni_mesh.connectors.errors import ConnectorClosed, ConnectorError, ConnectorUnavailable, PayloadMissing
from omni_mesh.connectors.keys import edge_key
from omni_mesh.connectors.pools.held import Gone, Held, HeldTable
from omni_mesh.connectors.pools.slots import SlotPool
from omni_mesh.connectors.served.channel import OK, Handler, RouterServer, frame_text
from omni_mesh.connectors.served.dealers import ChannelClosed, DealerPool, LateReply, PeerLost
from omni_mesh.connectors.served.guard import side_channel_keys
from omni_mesh.connectors.served.late_gets import LateGets

_RECENT_ERROR_S = 60.0  # health() reports "degraded" this long after an error
#: Longest a plain get() waits for the producer's answer (vllm-omni's polls expect about a second).
POLL_S = 1.0
#: A producer's answer: it holds no payload under that key (not yet, or not any more).
GONE = b"GONE"


class NoAnswer(PayloadMissing):
    """The producer did not answer in time: get() returns None, a wait to its deadline raises this."""


def producer_endpoint(fields: dict, cfg: Any) -> str | None:
    """tcp://host:port of the producer named by partial metadata, else by the config's sender fields."""
    host = fields.get("source_host", fields.get("host"))
    port = fields.get("source_port", fields.get("port", fields.get("zmq_port")))
    if host is None or port is None:
        host, port = getattr(cfg, "sender_host", None), getattr(cfg, "sender_zmq_port", None)
    if not host or port is None or str(host).lower() == "auto":
        return None
    try:
        return tcp_endpoint(str(host), int(port))
    except (TypeError, ValueError):
        return None


def _held_parts(key: str, put_key: str, token: str, size: int, buffer: Any, regions: list) -> Held:
    """A deferred payload sent from `buffer` (a list of parts) and empty() `regions` (`_hold_later`)."""
    return Held(key, put_key, token, size, None, buffer, regions=regions)


class ServedConnector(OmniConnectorBase):
    """Producer-held payloads served over a ZeroMQ side channel (module docstring)."""

    #: The config field holding the side channel's port (0: any free port).
    port_field: ClassVar[str] = "port"
    #: The metadata fields get() needs from put().
    metadata_fields: ClassVar[tuple[str, ...]] = ("endpoint",)
    #: The counters health() reports.
    counter_names: ClassVar[tuple[str, ...]] = (
        "puts", "gets", "bytes_put", "bytes_got", "errors", "expired", "asked_again"
    )

    def __init__(self, config: dict[str, Any] | None = None) -> None:
        super().__init__(config)
        cfg = self.config
        self._name = type(self).__name__
        self._bind_host, self.host = bind_and_advertise(cfg.host)
        self._keys = side_channel_keys(self._name)  # CURVE on the side channel, or None (warned once)
        self._open_backend()  # raises ConnectorError naming what is missing
        self._closed = False
        self._slots = self._new_slots(cfg)
        self._held = HeldTable(cfg.ttl_s, on_replaced=self._release, on_deferred=self._count_put)
        self._ctx = zmq.Context()
        self._dealers = DealerPool(self._ctx, self._keys)
        self._late = LateGets()  # polls whose answer is still on its way
        self._server: RouterServer | None = None
        self.endpoint: str | None = None
        self._lock = threading.Lock()
        self._last_error = -1e9
        self._counters = Counters(*self.counter_names)
        # Tokens tell puts apart (a stale get of a key put again finds nothing); not a secret: a get by
        # key alone needs none. A random prefix per instance and a counter: no syscall per put.
        self._token_prefix = secrets.token_hex(6)
        self._token_ids = itertools.count(1)

    # ---- hooks

    def _new_slots(self, cfg: Any) -> SlotPool:
        """The slot pool payloads are held in: memory_pool_size bytes, no growth."""
        return SlotPool(cfg.memory_pool_size)

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
                raise ConnectorClosed(f"{self._name}: the connector is closed")
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

    def _hold(
        self, key: str, put_key: str, size: int, offset: int | None, buffer: Any = None, regions: list | None = None
    ) -> Held:
        """Keep a payload for its consumer (replacing an earlier put of the key) and count the put."""
        held = Held(key, put_key, f"{self._token_prefix}{next(self._token_ids):x}", size, offset, buffer, regions=regions or [])
        replaced = self._held.add(held)
        if replaced is not None:
            self._release(replaced)
        self._counters.add_pair("puts", "bytes_put", size)
        return held

    def _hold_later(self, key: str, put_key: str, size: int, buffer: Any, regions: list) -> str:
        """`_hold` with the payload's bookkeeping deferred to the table's next reader (HeldTable.defer):
        the put of empty() outputs costs its metadata alone. Returns the token its metadata carries."""
        token = f"{self._token_prefix}{next(self._token_ids):x}"
        self._held.defer((_held_parts, key, put_key, token, size, buffer, regions))  # counted once stored
        if self._closed:  # close() may have emptied the table before this went in
            for held in self._held.pop_all():
                self._release(held)
            raise ConnectorClosed(f"{self._name}: the connector is closed")
        return token

    def _count_put(self, held: Held) -> None:
        self._counters.add_pair("puts", "bytes_put", held.size)

    @abstractmethod
    def _put(self, from_stage: str, to_stage: str, put_key: str, data: Any) -> tuple[int, dict | None]:
        """Store the payload; raise on failure (put() turns it into (False, 0, None) and a log line)."""

    def reap_consumed(self) -> None:
        """Free the slots of payloads whose consumers took them (their frames have left), and expire."""
        self._reap_sent()
        self._expire()

    def _reap_sent(self) -> None:
        """Slots whose frames went out since the last poll: reused while still warm."""
        server = self._server
        if server is not None:
            server.reap()

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

    #: Whether get() can find a payload by its key at an endpoint alone (partial or no metadata).
    by_key: ClassVar[bool] = True

    def _poll(
        self, from_stage: str, to_stage: str, get_key: str, metadata: dict | None
    ) -> tuple[Any, int] | None:
        """Ask the producer once, waiting at most POLL_S: PayloadMissing (get's None, in the base) if it
        has no such payload (yet, or any more) or does not answer in time."""
        return self._get(from_stage, to_stage, get_key, metadata, min(POLL_S, self.config.get_timeout_s), poll=True)

    def _wait_once(
        self, from_stage: str, to_stage: str, get_key: str, metadata: dict | None, deadline: float
    ) -> tuple[Any, int] | None:
        # The side-channel request itself waits for the answer (the whole transfer) until the deadline.
        return self._get(from_stage, to_stage, get_key, metadata, max(0.001, deadline - time.monotonic()), poll=False)

    def _get(
        self, from_stage: str, to_stage: str, get_key: str, metadata: Any, timeout: float, *, poll: bool
    ) -> tuple[Any, int] | None:
        key = edge_key(from_stage, to_stage, get_key)
        where = f"{self._name}: get {from_stage}->{to_stage} key {get_key!r}"
        if self._closed:
            raise ConnectorClosed(f"{where}: the connector is closed")
        located = self._locate(metadata, key, where)
        if located is None:
            return None
        endpoint, metadata = located
        try:
            obj, size = self._fetch(endpoint, key, metadata, timeout, f"{where} from {endpoint}", poll=poll)
        except Gone:
            if poll or metadata.get("token"):
                # A poll: PayloadMissing, the base's get says None. A wait with the put's own metadata:
                # it was there, and is no more (taken by another consumer, such as a replica that died
                # after its get, cleaned up or expired): asking again until the deadline brings nothing.
                raise
            return None  # not yet (a get by key alone may come before the put): the wait asks again
        # NoAnswer (a PayloadMissing): None for a poll, in the base; past the deadline, the wait's error
        self._counters.add_many(gets=1, bytes_got=size)
        return obj, size

    def _locate(self, metadata: Any, key: str, where: str) -> tuple[str, dict] | None:
        """The producer's endpoint and the metadata to ask it with: what put() returned, or, by the key
        alone, the producer named by partial metadata (vllm-omni's `source_host`/`source_port`, or
        `host`/`port`, or `endpoint`) or by the config's `sender_host`/`sender_zmq_port`."""
        if isinstance(metadata, dict) and metadata.get("key", key) != key:
            raise ConnectorError(f"{where}: the metadata is for {metadata['key']!r}, not this edge and key")
        fields = metadata if isinstance(metadata, dict) else {}
        endpoint = fields.get("endpoint")
        if isinstance(endpoint, str) and all(name in fields for name in self.metadata_fields):
            return endpoint, fields
        if not self.by_key:
            raise ConnectorError(
                f"{where}: needs the metadata put() returned ({', '.join(self.metadata_fields)}), got {metadata!r}"
            )
        if not isinstance(endpoint, str):
            endpoint = producer_endpoint(fields, self.config)
        if endpoint is None:
            return None  # nobody to ask: not there as far as this connector can know
        return endpoint, {"key": key}

    @abstractmethod
    def _fetch(
        self, endpoint: str, key: str, metadata: dict, timeout_s: float, where: str, *, poll: bool = False
    ) -> tuple[Any, int]:
        """Bring the payload from the producer at `endpoint` and decode it: (object, size). `poll`:
        a `get` that gives up after `timeout_s` (and may be tried again), not a deadline wait.

        Failures are ConnectorErrors starting with `where` (connector, edge, key and endpoint).
        """

    def _ask(
        self,
        endpoint: str,
        parts: list[bytes],
        timeout_s: float,
        where: str,
        late: str,
        *,
        late_key: str | None = None,
        keep_late: bool = False,
        late_session: Any = None,
        again_if_broken: bool = False,
    ) -> list[zmq.Frame]:
        """One side-channel request `[op, key, *args]`; the reply frames if the producer answered OK.

        Anything else is a ConnectorError starting with `where`; `late` says what no answer means.
        With `late_key` (a request whose answer carries the payload), a late request of that key
        kept earlier is waited on instead of a new one, and with `keep_late` one that is late now is
        kept (`_late`, with `late_session`). `again_if_broken` (a request the producer answers at
        most once, and GONE after): a request whose connection broke is sent once more on a new one,
        within `timeout_s`. A dropped connection loses only requests that had not reached the producer yet;
        one whose answer was under way is lost with it, and the second answer (GONE) says so.
        """
        deadline = time.monotonic() + timeout_s
        waiting = self._late.take(late_key, endpoint) if late_key is not None else None
        again = False
        try:
            if waiting is not None:  # a poll's request still waiting for its answer: wait on it again
                reply = self._dealers.resume(endpoint, waiting, timeout_s)
            else:
                try:
                    reply = self._dealers.request(endpoint, parts, timeout_s, keep_late=keep_late)
                except PeerLost as exc:
                    left = deadline - time.monotonic()
                    if not (again_if_broken and exc.broke and left > 0):
                        raise
                    exc.close()
                    again = True
                    self._counters.add("asked_again")
                    reply = self._dealers.request(endpoint, parts, left, keep_late=keep_late)
        except LateReply as exc:  # the answer may still come: the next get of the key waits for it
            if keep_late and late_key is not None and not isinstance(exc, PeerLost):
                self._late.keep(late_key, endpoint, exc, late_session)
                raise NoAnswer(f"{where}: {late}") from None
            exc.close()
            raise self._dealer_failure(exc, where, late) from None
        except (TimeoutError, ChannelClosed, zmq.ZMQError) as exc:
            raise self._dealer_failure(exc, where, late) from None
        if len(reply) < 2 or reply[1].bytes != parts[1]:
            self._error()
            raise ConnectorError(f"{where}: malformed reply")
        if reply[0].bytes == GONE:
            reason = frame_text(reply[2]) if len(reply) > 2 else "not there"
            if again:  # most likely taken by the request the broken connection lost
                self._error()
                raise PayloadMissing(
                    f"{where}: the connection to the producer broke while the payload was asked for, and "
                    f"asked again the producer no longer holds it ({reason}): it was on its way over the "
                    "broken connection and is lost with it"
                )
            raise Gone(f"{where}: {reason}")
        if reply[0].bytes != OK:
            self._error()
            raise ConnectorError(f"{where}: {frame_text(reply[2]) if len(reply) > 2 else 'refused'}")
        return reply

    def _dealer_failure(self, exc: BaseException, where: str, late: str) -> ConnectorError:
        """A DealerPool exception as the connector error family (the one place they are mapped)."""
        if isinstance(exc, ChannelClosed):
            return ConnectorClosed(f"{where}: the connector was closed")
        self._error()
        # Before the deadline: heartbeats and connection events said so, or the bulk stream ended early.
        if isinstance(exc, (PeerLost, ConnectionError)):
            return PayloadMissing(f"{where}: no answer will come: {exc}")
        if isinstance(exc, TimeoutError):  # LateReply and NotConnected too
            return NoAnswer(f"{where}: {late}")
        if isinstance(exc, zmq.ZMQError):
            return ConnectorUnavailable(f"{where}: {exc}")
        return ConnectorError(f"{where}: {type(exc).__name__}: {exc}")

    def abandon_get(self, key: str) -> None:
        super().abandon_get(key)
        self._late.drop(key)  # an answer still on its way is no longer waited for

    def _error(self) -> None:
        self._counters.add("errors")
        self._last_error = time.monotonic()

    _count_put_error = _error

    # ---- lifecycle

    def health(self) -> dict:
        server = self._server
        if self._closed or (server is not None and not server.alive):
            status = "unhealthy"
        elif time.monotonic() - self._last_error < _RECENT_ERROR_S:
            status = "degraded"
        else:
            status = "healthy"
        held = len(self._held)  # first: it stores (and counts) the puts whose bookkeeping was deferred
        report: dict[str, Any] = {"status": status, **self._counters.snapshot(), **self._put_health()}
        report.update(
            endpoint=self.endpoint,
            held=held,
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
        self._late.drop_all()
        self._dealers.close()
        self._held.pop_all()
        self._ctx.term()  # blocks until in-flight get()s (woken with ETERM) have closed their sockets
        self._close_backend()
