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

`host` is the address to bind and advertise; `auto` (the default) follows the rule in
omni_mesh.connectors._addresses, and `0.0.0.0` binds every interface and advertises the `auto` address.
The side channel, the held-payload table and health() are ServedConnector's (omni_mesh.connectors._served).
"""

from __future__ import annotations

import contextlib
import mmap
from dataclasses import dataclass
from typing import Any

from omni_mesh.codec import FrameError, decode, plan
from omni_mesh.connectors._checks import check_served
from omni_mesh.connectors._served import GONE, ServedConnector
from omni_mesh.connectors._zmq_channel import OK, Handler, Reply, frame_text
from omni_mesh.connectors.base import ConnectorError, edge_key


@dataclass
class ZmqConfig:
    host: str = "auto"  # address to bind and advertise ("auto": rule in omni_mesh.connectors._addresses)
    port: int = 0  # 0: any free port
    memory_pool_size: int = 1 << 30  # virtual until used; reused slots stay faulted in
    ttl_s: float = 300.0  # unconsumed payloads are freed after this; 0 keeps them until cleanup()
    get_timeout_s: float = 30.0  # deadline of get() when the caller gives none

    def check(self, owner: str) -> None:
        check_served(owner, "port", self.port, get_timeout_s=self.get_timeout_s, ttl_s=self.ttl_s)


def _anonymous_map(size: int) -> mmap.mmap:
    """Page-aligned memory (so 64-byte aligned slots); huge pages make its first touch ~5x cheaper."""
    region = mmap.mmap(-1, size)
    with contextlib.suppress(AttributeError, OSError):  # no THP support: plain pages
        region.madvise(mmap.MADV_HUGEPAGE)
    return region


class ZmqConnector(ServedConnector):
    """Cross-host payloads over ZeroMQ, served from the producer's own memory pool (module docstring)."""

    config_class = ZmqConfig
    scope = "network"
    port_field = "port"
    counter_names = (*ServedConnector.counter_names, "oneoff")

    def __init__(self, config: dict[str, Any] | None = None) -> None:
        super().__init__(config)
        self._pool: mmap.mmap | None = None  # created with the server, on the first put
        self._in_flight = 0

    # ---------------------------------------------------------------- producer side

    def _serving_handlers(self) -> dict[bytes, Handler]:
        if self._slots.size:
            self._pool = _anonymous_map(self._slots.size)
        return {b"GET": self._serve}

    def _put(self, from_stage: str, to_stage: str, put_key: str, data: Any) -> tuple[bool, int, dict | None]:
        frame = plan(data)
        self._start_server()
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
        held = self._hold(key, put_key, frame.nbytes, offset, buffer)
        return (
            True,
            frame.nbytes,
            {"endpoint": self.endpoint, "key": key, "token": held.token, "size": frame.nbytes},
        )

    def _serve(self, args: list[bytes]) -> Reply:
        """GET key token -> OK key frame (runs on the server thread)."""
        key, token = args[0], frame_text(args[1])
        held = self._held.take(frame_text(key), token)
        if isinstance(held, str):  # not (or no more) there: the consumer's get() answers None
            return [GONE, key, held.encode()], None
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

    # ---------------------------------------------------------------- consumer side

    def _fetch(
        self, endpoint: str, key: str, metadata: dict, timeout_s: float, where: str
    ) -> tuple[Any, int]:
        """GET key token -> the frame, decoded as views over the received message."""
        late = (
            f"no answer within {timeout_s:.3g}s; the producing process is gone, its host is unreachable, "
            "or the payload is still in transit (raise get_timeout_s)"
        )
        token = str(metadata.get("token", ""))
        reply = self._ask(endpoint, [b"GET", key.encode(), token.encode()], timeout_s, where, late)
        if len(reply) != 3:
            self._error()
            raise ConnectorError(f"{where}: malformed reply")
        frame = reply[2]
        try:
            obj = decode(frame.buffer)  # views over the received message; it lives as long as they do
        except FrameError as exc:
            self._error()
            raise ConnectorError(f"{where}: corrupt frame: {exc}") from None
        return obj, len(frame.buffer)

    # ---------------------------------------------------------------- lifecycle

    def health(self) -> dict:
        report = super().health()
        report["in_flight"] = self._in_flight
        return report

    def _close_backend(self) -> None:
        self._pool = None  # unmapped once every frame sent from it is released
