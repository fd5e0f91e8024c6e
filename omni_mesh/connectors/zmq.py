"""ZmqConnector: payloads served over ZeroMQ straight from the producer's memory (cross-host, nothing to deploy).

Data path of one payload:

    put   plan(data).write_into(pool slot)      one copy, into a reused (already faulted-in) memory pool
          -> metadata {"endpoint", "key", "token", "size"}
    get   DEALER ["GET", key, token] -> the producer's ROUTER thread answers ["OK", key, frame], sending
          the pool slot zero-copy; the consumer decodes views over the received message (no copy)

Serving a payload consumes it: the slot is freed as soon as libzmq lets go of the sent message, with no
acknowledgement round trip. Payloads nobody asks for are freed after `ttl_s` or by `cleanup()`. A
payload larger than the free pool goes into a one-off buffer instead. A consumer whose producer died
(or whose network is cut) gets a ConnectorError naming the endpoint and key at its deadline; a socket
that timed out is discarded, so a late answer can never be mistaken for the next one.

`host: auto` resolves, in order, to:
  1. the source address the kernel picks for a route to the outside world (a UDP `connect`, which
     sends nothing), so a multi-homed host advertises the interface its default route uses;
  2. else (no default route, e.g. an isolated network namespace) the first IPv4 address of an
     interface that is up and not loopback;
  3. else 127.0.0.1.
Set `host` to an explicit address to override the rule; `0.0.0.0` binds every interface and
advertises the `auto` address.

This module also holds the ZeroMQ side-channel pieces the transfer-engine connectors (Yuanrong TE,
Mori) share: `RouterServer`, `DealerPool`, `HeldTable`, and their common base `EnginePullConnector`.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import mmap
import secrets
import socket
import struct
import threading
import time
from abc import abstractmethod
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import zmq

from omni_mesh.codec import FrameError, FramePlan, decode, plan
from omni_mesh.connectors.allocator import PoolAllocator
from omni_mesh.connectors.base import (
    ConnectorConfigError,
    ConnectorError,
    Counters,
    OmniConnectorBase,
    edge_key,
    parse_config,
)

_POLL_MS = 50  # server loop granularity: how late a TTL expiry or a stop request may be noticed
_TICK_S = 0.1
_RECENT_ERROR_S = 60.0  # health() reports "degraded" this long after an error
_SIOCGIFFLAGS = 0x8913
_SIOCGIFADDR = 0x8915
_IFF_UP = 0x1
_IFF_LOOPBACK = 0x8

OK = b"OK"
ERR = b"ERR"


# --------------------------------------------------------------------------- addresses


def outward_address() -> str:
    """This host's address as its peers see it (the `host: auto` rule in the module docstring)."""
    with contextlib.suppress(OSError), socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect(("192.0.2.1", 9))  # TEST-NET-1: any routed address works, nothing is sent
        address = probe.getsockname()[0]
        if not address.startswith("127.") and address != "0.0.0.0":
            return address
    for _, name in socket.if_nameindex():
        address = _interface_address(name)
        if address is not None:
            return address
    return "127.0.0.1"


def _interface_address(name: str) -> str | None:
    """IPv4 address of an up, non-loopback interface (Linux ioctls; no extra dependency)."""
    request = struct.pack("256s", name.encode()[:15])
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            flags = struct.unpack_from("H", fcntl.ioctl(sock.fileno(), _SIOCGIFFLAGS, request), 16)[0]
            if not flags & _IFF_UP or flags & _IFF_LOOPBACK:
                return None
            return socket.inet_ntoa(fcntl.ioctl(sock.fileno(), _SIOCGIFADDR, request)[20:24])
        except OSError:  # no IPv4 address on it
            return None


def resolve_host(value: str) -> tuple[str, str]:
    """(address to bind, address to advertise) for a `host` config value."""
    value = value.strip()
    if value.lower() == "auto":
        address = outward_address()
        return address, address
    if value in ("0.0.0.0", "*", "::"):
        return value, outward_address()
    return value, value


def tcp_endpoint(host: str, port: int | str) -> str:
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


def check_port(owner: str, name: str, port: int) -> None:
    if not 0 <= port < 65536:
        raise ConnectorConfigError(f"{owner}: {name} must be 0 (any free port) or 1-65535, got {port}")


def check_positive(owner: str, **values: float) -> None:
    for name, value in values.items():
        if value <= 0:
            raise ConnectorConfigError(f"{owner}: {name} must be positive, got {value!r}")


def check_not_negative(owner: str, **values: float) -> None:
    for name, value in values.items():
        if value < 0:
            raise ConnectorConfigError(f"{owner}: {name} must not be negative, got {value!r}")


# --------------------------------------------------------------------------- producer bookkeeping


class SlotPool:
    """Thread-safe first-fit offsets (64-byte aligned) into a pool of `size` bytes; never touches memory."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._allocator = PoolAllocator(size)
        self._lock = threading.Lock()

    def allocate(self, nbytes: int) -> int | None:
        with self._lock:
            return self._allocator.allocate(nbytes)

    def free(self, offset: int) -> None:
        with self._lock:
            self._allocator.free(offset)

    @property
    def in_use(self) -> int:
        with self._lock:
            return self._allocator.in_use


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


class HeldTable:
    """Payloads waiting for consumers, by edge key; expiry and request-prefix cleanup. Thread-safe.

    A claimed payload (a consumer is pulling it) that is cleaned up or replaced by a new put of the
    same key is retired, not freed: its slot is freed when the reader releases it or at expiry.
    """

    def __init__(self, ttl_s: float) -> None:
        self.ttl_s = ttl_s
        self._items: dict[str, Held] = {}
        self._retired: dict[tuple[str, str], Held] = {}
        self._lock = threading.Lock()

    def gone(self) -> str:
        if self.ttl_s > 0:
            return f"no payload under this key: already consumed, cleaned up, or expired after ttl_s={self.ttl_s:g}"
        return "no payload under this key: already consumed or cleaned up"

    def add(self, held: Held) -> Held | None:
        """Store `held`; returns the unclaimed payload it replaces (to be freed by the caller), if any."""
        with self._lock:
            old = self._items.pop(held.key, None)
            self._items[held.key] = held
            if old is not None and old.claimed:
                self._retired[(old.key, old.token)] = old
                return None
            return old

    def _find(self, key: str, token: str) -> Held | str:
        held = self._items.get(key)
        if held is None:
            return self.gone()
        if not secrets.compare_digest(held.token, token):
            return "token mismatch: the metadata belongs to another put of this key"
        return held

    def take(self, key: str, token: str) -> Held | str:
        """Remove and return the payload, or the reason it is not there."""
        with self._lock:
            retired = self._retired.pop((key, token), None)
            if retired is not None:
                return retired
            found = self._find(key, token)
            if isinstance(found, Held):
                del self._items[key]
            return found

    def claim(self, key: str, token: str) -> Held | str:
        """Mark the payload as being read: it stays until released (or expired)."""
        with self._lock:
            found = self._find(key, token)
            if isinstance(found, Held):
                found.claimed = True
                found.touched = time.monotonic()
            return found

    def pop_expired(self, now: float) -> list[Held]:
        if self.ttl_s <= 0:
            return []
        with self._lock:
            stale = [key for key, held in self._items.items() if now - held.touched > self.ttl_s]
            expired = [self._items.pop(key) for key in stale]
            stale_retired = [ref for ref, held in self._retired.items() if now - held.touched > self.ttl_s]
            expired += [self._retired.pop(ref) for ref in stale_retired]
            return expired

    def pop_matching(self, key: str) -> list[Held]:
        """Unclaimed payloads whose put_key is `key` or starts with `key/` (claimed ones are retired)."""
        prefix = key + "/"
        with self._lock:
            matching = [k for k, h in self._items.items() if h.put_key == key or h.put_key.startswith(prefix)]
            freed = []
            for k in matching:
                held = self._items.pop(k)
                if held.claimed:
                    self._retired[(held.key, held.token)] = held
                else:
                    freed.append(held)
            return freed

    def pop_all(self) -> list[Held]:
        with self._lock:
            items = [*self._items.values(), *self._retired.values()]
            self._items.clear()
            self._retired.clear()
            return items

    def __len__(self) -> int:
        with self._lock:
            return len(self._items) + len(self._retired)


# --------------------------------------------------------------------------- ZeroMQ plumbing

Reply = tuple[list[Any], "Callable[[], None] | None"]
Handler = Callable[[list[bytes]], Reply]


class RouterServer:
    """A ROUTER socket served by one background thread.

    Requests are [op, *args]; `handlers[op](args)` returns (reply frames, on_sent). Reply frames are
    sent zero-copy; `on_sent` runs once libzmq has let go of them (the memory may then be reused).
    `tick()` runs between polls for housekeeping such as TTL expiry.
    """

    def __init__(
        self,
        ctx: zmq.Context,
        bind_host: str,
        port: int,
        handlers: dict[bytes, Handler],
        tick: Callable[[], None],
        owner: str,
    ) -> None:
        self._ctx = ctx
        self._bind = tcp_endpoint(bind_host, port or "*")
        self._handlers = handlers
        self._tick = tick
        self._owner = owner
        self._stop = threading.Event()
        self._ready = threading.Event()
        self.port = 0
        self.error: BaseException | None = None
        self._pending: list[tuple[zmq.MessageTracker, Callable[[], None]]] = []
        self._pending_lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name=f"{owner}-server", daemon=True)

    def start(self) -> int:
        self._thread.start()
        self._ready.wait(10)
        if self.error is not None or not self.port:
            raise ConnectorError(
                f"{self._owner}: cannot serve on {self._bind}: {self.error or 'bind timed out'}; "
                "set `port` to a free port (0 picks any) and `host` to an address of this host"
            )
        return self.port

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(5)

    def _run(self) -> None:
        try:
            sock = self._ctx.socket(zmq.ROUTER)
        except zmq.ZMQError as exc:
            self.error = exc
            self._ready.set()
            return
        try:
            sock.setsockopt(zmq.LINGER, 0)
            if self._bind.startswith("tcp://["):
                sock.setsockopt(zmq.IPV6, 1)
            sock.bind(self._bind)
            self.port = int(sock.getsockopt_string(zmq.LAST_ENDPOINT).rsplit(":", 1)[1])
            self._ready.set()
            self._serve(sock)
        except BaseException as exc:  # surfaced by start() and by the owner's health()
            self.error = exc
        finally:
            self._ready.set()
            sock.close(linger=0)

    def reap(self) -> None:
        """Run `on_sent` for every reply libzmq has let go of (any thread may call this)."""
        with self._pending_lock:
            if not self._pending:
                return
            done, keep = [], []
            for item in self._pending:
                (done if item[0].done else keep).append(item)
            self._pending = keep
        for _, on_sent in done:
            on_sent()

    def _serve(self, sock: zmq.Socket) -> None:
        next_tick = time.monotonic()
        while not self._stop.is_set():
            if sock.poll(_POLL_MS, zmq.POLLIN):
                for _ in range(256):  # drain what is queued, then do housekeeping
                    try:
                        request = sock.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self._answer(sock, request)
            self.reap()
            now = time.monotonic()
            if now >= next_tick:
                next_tick = now + _TICK_S
                with contextlib.suppress(Exception):  # housekeeping must never stop the server
                    self._tick()

    def _answer(self, sock: zmq.Socket, request: list[bytes]) -> None:
        if len(request) < 2:
            return  # not a request of ours: there is nothing sensible to answer
        identity, op, args = request[0], request[1], request[2:]
        on_sent = None
        handler = self._handlers.get(op)
        try:
            if handler is None:
                raise ValueError(f"unknown request {op[:32]!r}")
            frames, on_sent = handler(args)
        except Exception as exc:  # a bad request must never stop the server
            frames = [ERR, args[0] if args else b"", f"{type(exc).__name__}: {exc}".encode()]
        try:
            tracker = sock.send_multipart([identity, *frames], copy=False, track=on_sent is not None)
        except zmq.ZMQError:
            tracker = None  # the peer is gone: the message is dropped, its memory released
        if on_sent is not None:
            if tracker is None or tracker.done:
                on_sent()
            else:
                with self._pending_lock:
                    self._pending.append((tracker, on_sent))


class ChannelClosed(Exception):
    """The connector was closed while a request was in flight."""


class DealerPool:
    """Request/reply to ROUTER endpoints from many threads.

    Idle DEALER sockets are cached per endpoint (usually one); a thread checks one out for a whole
    request, so concurrent requests never share a socket. A socket whose request failed or timed out
    is closed (LINGER 0), never reused: a late reply cannot be read as the answer to the next request.
    Only the most recently used endpoints keep idle sockets, so producers that come and go (restarted
    replicas, new ports) do not leave sockets reconnecting forever.
    """

    MAX_ENDPOINTS = 64
    MAX_IDLE_PER_ENDPOINT = 8

    def __init__(self, ctx: zmq.Context) -> None:
        self._ctx = ctx
        self._idle: OrderedDict[str, list[zmq.Socket]] = OrderedDict()
        self._lock = threading.Lock()
        self._closed = False

    def request(self, endpoint: str, parts: list[bytes], timeout_s: float) -> list[zmq.Frame]:
        """Send `parts` and return the reply frames (zero-copy); TimeoutError past `timeout_s`."""
        sock = self._checkout(endpoint)
        try:
            sock.send_multipart(parts, zmq.NOBLOCK)
            if not sock.poll(max(0, int(timeout_s * 1000)), zmq.POLLIN):
                raise TimeoutError(f"no reply within {timeout_s:g}s")
            reply = sock.recv_multipart(copy=False)
        except BaseException as exc:
            sock.close(linger=0)
            if isinstance(exc, zmq.ZMQError) and exc.errno in (errno.ENOTSOCK, zmq.ETERM):
                raise ChannelClosed() from None
            if isinstance(exc, zmq.Again):
                raise TimeoutError("the send queue is full") from None
            raise
        self._checkin(endpoint, sock)
        return reply

    def _checkout(self, endpoint: str) -> zmq.Socket:
        with self._lock:
            if self._closed:
                raise ChannelClosed()
            idle = self._idle.get(endpoint)
            if idle:
                return idle.pop()
            try:
                sock = self._ctx.socket(zmq.DEALER)
            except zmq.ZMQError:
                raise ChannelClosed() from None
        try:
            sock.setsockopt(zmq.LINGER, 0)
            if endpoint.startswith("tcp://["):
                sock.setsockopt(zmq.IPV6, 1)
            sock.connect(endpoint)  # raises for a malformed endpoint
        except BaseException:
            sock.close(linger=0)
            raise
        return sock

    def _checkin(self, endpoint: str, sock: zmq.Socket) -> None:
        evicted = [sock]
        with self._lock:
            if not self._closed:
                idle = self._idle.setdefault(endpoint, [])
                self._idle.move_to_end(endpoint)
                if len(idle) < self.MAX_IDLE_PER_ENDPOINT:
                    idle.append(sock)
                    evicted = []
                while len(self._idle) > self.MAX_ENDPOINTS:
                    evicted += self._idle.popitem(last=False)[1]
        for old in evicted:
            old.close(linger=0)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            sockets = [s for idle in self._idle.values() for s in idle]
            self._idle.clear()
        for sock in sockets:
            sock.close(linger=0)


def _anonymous_map(size: int) -> mmap.mmap:
    """Page-aligned memory (so 64-byte aligned slots); huge pages make its first touch ~5x cheaper."""
    region = mmap.mmap(-1, size)
    with contextlib.suppress(AttributeError, OSError):  # no THP support: plain pages
        region.madvise(mmap.MADV_HUGEPAGE)
    return region


def _text(frame: Any) -> str:
    data = frame.bytes if isinstance(frame, zmq.Frame) else frame
    return bytes(data).decode("utf-8", "replace")


# --------------------------------------------------------------------------- ZmqConnector


@dataclass
class ZmqConfig:
    host: str = "auto"  # address to bind and advertise ("auto": rule in the module docstring)
    port: int = 0  # 0: any free port
    memory_pool_size: int = 1 << 30  # virtual until used; reused slots stay faulted in
    ttl_s: float = 300.0  # unconsumed payloads are freed after this; 0 keeps them until cleanup()
    get_timeout_s: float = 30.0  # deadline of get() when the caller gives none


class ZmqConnector(OmniConnectorBase):
    """Cross-host payloads over ZeroMQ, served from the producer's own memory pool (module docstring)."""

    config_class = ZmqConfig
    scope = "network"

    def __init__(self, config: dict[str, Any] | None = None) -> None:
        super().__init__(config)
        cfg: ZmqConfig = self.config
        self._check(cfg)
        self._bind_host, self.host = resolve_host(cfg.host)
        self._ctx = zmq.Context()
        self._dealers = DealerPool(self._ctx)
        self._held = HeldTable(cfg.ttl_s)
        self._slots = SlotPool(cfg.memory_pool_size)
        self._pool: mmap.mmap | None = None  # created with the server, on the first put
        self._server: RouterServer | None = None
        self.endpoint: str | None = None
        self._lock = threading.Lock()
        self._closed = False
        self._in_flight = 0
        self._last_error = -1e9
        self._counters = Counters("puts", "gets", "bytes_put", "bytes_got", "errors", "expired", "oneoff")

    @classmethod
    def validate_config(cls, config: dict[str, Any] | None) -> None:
        cls._check(parse_config(cls.config_class, config, owner=cls.__name__))

    @classmethod
    def _check(cls, cfg: ZmqConfig) -> None:
        check_port(cls.__name__, "port", cfg.port)
        check_positive(cls.__name__, get_timeout_s=cfg.get_timeout_s)
        check_not_negative(cls.__name__, ttl_s=cfg.ttl_s)

    # ---------------------------------------------------------------- producer side

    def _start_producer(self) -> None:
        with self._lock:
            if self._closed:
                raise ConnectorError(f"ZmqConnector: closed (producer at {self.endpoint})")
            if self._server is not None:
                return
            if self._slots.size:
                self._pool = _anonymous_map(self._slots.size)
            server = RouterServer(
                self._ctx,
                self._bind_host,
                self.config.port,
                {b"GET": self._serve},
                self._expire,
                "ZmqConnector",
            )
            port = server.start()
            self._server = server
            self.endpoint = tcp_endpoint(self.host, port)

    def put(self, from_stage: str, to_stage: str, put_key: str, data: Any) -> tuple[bool, int, dict | None]:
        frame = plan(data)
        self._start_producer()
        key = edge_key(from_stage, to_stage, put_key)
        self._server.reap()  # slots whose frames went out since the last poll: reuse them, still warm
        offset = self._slots.allocate(frame.nbytes)
        buffer = None
        try:
            if offset is None:  # larger than the free pool: a one-off buffer, freed like a slot
                buffer = _anonymous_map(frame.nbytes)
                frame.write_into(buffer)
                self._counters.add("oneoff")
            else:
                frame.write_into(self._pool, offset)
        except BaseException:
            if offset is not None:
                self._slots.free(offset)
            raise
        held = Held(key, put_key, secrets.token_hex(8), frame.nbytes, offset, buffer)
        replaced = self._held.add(held)
        if replaced is not None:
            self._release(replaced)
        self._counters.add("puts")
        self._counters.add("bytes_put", frame.nbytes)
        return (
            True,
            frame.nbytes,
            {"endpoint": self.endpoint, "key": key, "token": held.token, "size": frame.nbytes},
        )

    def _serve(self, args: list[bytes]) -> Reply:
        """GET key token -> OK key frame (runs on the server thread)."""
        key, token = args[0], _text(args[1])
        held = self._held.take(_text(key), token)
        if isinstance(held, str):
            return [ERR, key, held.encode()], None
        if held.offset is None:
            payload = memoryview(held.buffer)[: held.size]
        else:
            payload = memoryview(self._pool)[held.offset : held.offset + held.size]
        with self._lock:
            self._in_flight += 1

        def sent() -> None:
            with self._lock:
                self._in_flight -= 1
            self._release(held)

        return [OK, key, payload], sent

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

    # ---------------------------------------------------------------- consumer side

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
        edge = f"{from_stage}->{to_stage}"
        key = edge_key(from_stage, to_stage, get_key)
        where = f"ZmqConnector: get {edge} key {get_key!r}"
        if not isinstance(metadata, dict) or not isinstance(metadata.get("endpoint"), str):
            raise ConnectorError(
                f"{where}: needs the metadata put() returned (with its endpoint), got {metadata!r}"
            )
        endpoint, token = metadata["endpoint"], str(metadata.get("token", ""))
        if metadata.get("key", key) != key:
            raise ConnectorError(f"{where}: the metadata is for {metadata['key']!r}, not this edge and key")
        if self._closed:
            raise ConnectorError(f"{where}: the connector is closed")
        timeout = self.config.get_timeout_s if timeout_s is None else timeout_s
        try:
            reply = self._dealers.request(endpoint, [b"GET", key.encode(), token.encode()], timeout)
        except TimeoutError:
            self._error()
            raise ConnectorError(
                f"{where} from {endpoint}: no answer within {timeout:g}s; the producing process is gone, "
                "its host is unreachable, or the payload is still in transit (raise get_timeout_s)"
            ) from None
        except ChannelClosed:
            raise ConnectorError(f"{where}: the connector was closed") from None
        except zmq.ZMQError as exc:
            self._error()
            raise ConnectorError(f"{where} from {endpoint}: {exc}") from None
        if len(reply) < 2 or reply[1].bytes != key.encode():
            self._error()
            raise ConnectorError(f"{where} from {endpoint}: malformed reply")
        if reply[0].bytes != OK or len(reply) != 3:
            self._error()
            reason = _text(reply[2]) if len(reply) > 2 else "refused"
            raise ConnectorError(f"{where} from {endpoint}: {reason}")
        frame = reply[2]
        try:
            obj = decode(frame.buffer)  # views over the received message; it lives as long as they do
        except FrameError as exc:
            self._error()
            raise ConnectorError(f"{where} from {endpoint}: corrupt frame: {exc}") from None
        size = len(frame.buffer)
        self._counters.add("gets")
        self._counters.add("bytes_got", size)
        return obj, size

    def _error(self) -> None:
        self._counters.add("errors")
        self._last_error = time.monotonic()

    # ---------------------------------------------------------------- lifecycle

    def health(self) -> dict:
        counters = self._counters.snapshot()
        server = self._server
        if self._closed or (server is not None and not server.alive):
            status = "unhealthy"
        elif time.monotonic() - self._last_error < _RECENT_ERROR_S:
            status = "degraded"
        else:
            status = "healthy"
        report: dict[str, Any] = {"status": status, **counters}
        report.update(
            endpoint=self.endpoint,
            held=len(self._held),
            in_flight=self._in_flight,
            pool_bytes=self._slots.size,
            pool_used_bytes=self._slots.in_use,
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
        self._pool = None  # unmapped once every frame sent from it is released


# --------------------------------------------------------------------------- transfer-engine base


class EnginePullConnector(OmniConnectorBase):
    """Base of the transfer-engine connectors (Yuanrong TE, Mori): the consumer pulls the frame.

    The producer lays the frame into its registered memory pool and returns metadata naming the slot
    and a ZeroMQ side channel. The consumer claims the payload over the side channel (so it cannot
    expire or be cleaned up mid-read), pulls the bytes into its own registered pool with the engine,
    releases the payload (the producer frees the slot) and decodes. Subclasses supply the engine.

    Config fields every subclass has: host, zmq_port, memory_pool_size, ttl_s, get_timeout_s.
    """

    def __init__(self, config: dict[str, Any] | None = None) -> None:
        super().__init__(config)
        cfg = self.config
        self._name = type(self).__name__
        self._check(cfg)
        self._bind_host, self.host = resolve_host(cfg.host)
        self._open_backend()  # raises ConnectorError naming what is missing
        self._closed = False
        self._slots = SlotPool(cfg.memory_pool_size)
        self._held = HeldTable(cfg.ttl_s)
        self._ctx = zmq.Context()
        self._dealers = DealerPool(self._ctx)
        self._server: RouterServer | None = None
        self.endpoint: str | None = None
        self._lock = threading.Lock()
        self._orphans: list[tuple[Any, int]] = []  # (unfinished transfer, local offset) after a timeout
        self._last_error = -1e9
        self._counters = Counters("puts", "gets", "bytes_put", "bytes_got", "errors", "expired")

    @classmethod
    def validate_config(cls, config: dict[str, Any] | None) -> None:
        cls._check(parse_config(cls.config_class, config, owner=cls.__name__))

    @classmethod
    def _check(cls, cfg: Any) -> None:
        """Check config values before any backend is looked for; subclasses extend it."""
        check_port(cls.__name__, "zmq_port", cfg.zmq_port)
        check_positive(cls.__name__, get_timeout_s=cfg.get_timeout_s, memory_pool_size=cfg.memory_pool_size)
        check_not_negative(cls.__name__, ttl_s=cfg.ttl_s)

    # ---- what a subclass provides

    @abstractmethod
    def _open_backend(self) -> None:
        """Import the backend, start the engine, allocate and register a memory_pool_size pool."""

    @abstractmethod
    def _write_frame(self, frame: FramePlan, offset: int) -> None:
        """Lay `frame` into the pool at `offset` (through a host staging buffer for device pools)."""

    @abstractmethod
    def _engine_metadata(self) -> dict[str, Any]:
        """Small msgpack-able fields a remote consumer needs to reach this pool with the engine."""

    @abstractmethod
    def _pull(self, metadata: dict[str, Any], local_offset: int, size: int, deadline: float) -> Any:
        """Copy `size` bytes from the producer's slot into our pool at `local_offset`.

        Returns None when done, or an unfinished transfer handle (past the deadline) that
        `_transfer_done(handle)` can be asked about later. Raises ConnectorError with the engine's
        reason on failure (the caller adds connector, edge, key and endpoint).
        """

    def _transfer_done(self, handle: Any) -> bool:
        return True

    @abstractmethod
    def _decode_slot(self, offset: int, size: int) -> Any:
        """Decode the frame at `offset` of our pool into objects that do not reference the pool."""

    @abstractmethod
    def _close_backend(self) -> None: ...

    # ---- producer side

    def _start_server(self) -> None:
        with self._lock:
            if self._closed:
                raise ConnectorError(f"{self._name}: closed")
            if self._server is not None:
                return
            handlers = {b"CLAIM": self._on_claim, b"RELEASE": self._on_release}
            server = RouterServer(
                self._ctx, self._bind_host, self.config.zmq_port, handlers, self._expire, self._name
            )
            port = server.start()
            self._server = server
            self.endpoint = tcp_endpoint(self.host, port)

    def put(self, from_stage: str, to_stage: str, put_key: str, data: Any) -> tuple[bool, int, dict | None]:
        frame = plan(data)
        self._start_server()
        key = edge_key(from_stage, to_stage, put_key)
        offset = self._slots.allocate(frame.nbytes)
        if offset is None:
            self._error()
            raise ConnectorError(
                f"{self._name}: put {from_stage}->{to_stage} key {put_key!r}: the memory pool is full "
                f"({frame.nbytes} bytes needed, {self._slots.size - self._slots.in_use} of {self._slots.size} "
                f"free, {len(self._held)} payloads waiting); raise memory_pool_size or consume faster"
            )
        try:
            self._write_frame(frame, offset)
        except BaseException:
            self._slots.free(offset)
            raise
        held = Held(key, put_key, secrets.token_hex(8), frame.nbytes, offset)
        replaced = self._held.add(held)
        if replaced is not None:
            self._slots.free(replaced.offset)
        self._counters.add("puts")
        self._counters.add("bytes_put", frame.nbytes)
        metadata = {
            "endpoint": self.endpoint,
            "key": key,
            "token": held.token,
            "offset": offset,
            "size": frame.nbytes,
        }
        metadata.update(self._engine_metadata())
        return True, frame.nbytes, metadata

    def _on_claim(self, args: list[bytes]) -> Reply:
        held = self._held.claim(_text(args[0]), _text(args[1]))
        return ([ERR, args[0], held.encode()] if isinstance(held, str) else [OK, args[0]]), None

    def _on_release(self, args: list[bytes]) -> Reply:
        held = self._held.take(_text(args[0]), _text(args[1]))
        if isinstance(held, str):
            return [ERR, args[0], held.encode()], None
        self._slots.free(held.offset)
        return [OK, args[0]], None

    def _expire(self) -> None:
        for held in self._held.pop_expired(time.monotonic()):
            self._slots.free(held.offset)
            self._counters.add("expired")

    def cleanup(self, key: str) -> None:
        for held in self._held.pop_matching(key):
            self._slots.free(held.offset)

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
        """Claim, pull, release and decode the payload; `timeout_s` overrides get_timeout_s for this call."""
        key = edge_key(from_stage, to_stage, get_key)
        where = f"{self._name}: get {from_stage}->{to_stage} key {get_key!r}"
        needed = ("endpoint", "token", "offset", "size")
        if not isinstance(metadata, dict) or any(name not in metadata for name in needed):
            raise ConnectorError(
                f"{where}: needs the metadata put() returned ({', '.join(needed)}), got {metadata!r}"
            )
        if metadata.get("key", key) != key:
            raise ConnectorError(f"{where}: the metadata is for {metadata['key']!r}, not this edge and key")
        if self._closed:
            raise ConnectorError(f"{where}: the connector is closed")
        endpoint, size = str(metadata["endpoint"]), int(metadata["size"])
        where = f"{where} from {endpoint}"
        deadline = time.monotonic() + (self.config.get_timeout_s if timeout_s is None else timeout_s)
        request = [key.encode(), str(metadata["token"]).encode()]
        self._side_request(endpoint, b"CLAIM", request, deadline, where)
        offset = self._local_slot(size, deadline, where)
        unfinished = None
        try:
            try:
                unfinished = self._pull(metadata, offset, size, deadline)
            except ConnectorError as exc:  # the engine's reason, here with edge, key and endpoint
                self._error()
                raise ConnectorError(f"{where}: {exc}") from exc
            if unfinished is not None:
                self._error()
                raise ConnectorError(f"{where}: the transfer did not finish by the deadline")
            obj = self._decode_slot(offset, size)
        except FrameError as exc:
            self._error()
            raise ConnectorError(f"{where}: corrupt frame: {exc}") from None
        finally:
            if unfinished is None:
                self._slots.free(offset)
            else:  # the engine may still write there: free the slot once it has finished
                with self._lock:
                    self._orphans.append((unfinished, offset))
        # The payload is ours now: a lost release only delays the producer's free to its ttl_s.
        with contextlib.suppress(ConnectorError):
            self._side_request(endpoint, b"RELEASE", request, max(deadline, time.monotonic() + 1.0), where)
        self._counters.add("gets")
        self._counters.add("bytes_got", size)
        return obj, size

    def _side_request(self, endpoint: str, op: bytes, args: list[bytes], deadline: float, where: str) -> None:
        timeout = max(0.0, deadline - time.monotonic())
        try:
            reply = self._dealers.request(endpoint, [op, *args], timeout)
        except TimeoutError:
            self._error()
            raise ConnectorError(
                f"{where}: no answer to {op.decode()} within {timeout:.1f}s; the producing process is gone "
                "or its host is unreachable"
            ) from None
        except ChannelClosed:
            raise ConnectorError(f"{where}: the connector was closed") from None
        if not reply or reply[0].bytes != OK:
            self._error()
            reason = _text(reply[2]) if len(reply) > 2 else "malformed reply"
            raise ConnectorError(f"{where}: {reason}")

    def _local_slot(self, size: int, deadline: float, where: str) -> int:
        while True:
            self._reap_orphans()
            offset = self._slots.allocate(size)
            if offset is not None:
                return offset
            if time.monotonic() >= deadline:
                self._error()
                raise ConnectorError(
                    f"{where}: no room for {size} bytes in this consumer's memory pool "
                    f"({self._slots.size - self._slots.in_use} of {self._slots.size} free) before the deadline; "
                    "raise memory_pool_size"
                )
            time.sleep(0.002)  # other gets finish and free their slots

    def _reap_orphans(self) -> None:
        with self._lock:
            if not self._orphans:
                return
            keep, done = [], []
            for orphan in self._orphans:
                (done if self._transfer_done(orphan[0]) else keep).append(orphan)
            self._orphans = keep
        for _, offset in done:
            self._slots.free(offset)

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
        )
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
        self._ctx.term()
        self._close_backend()
