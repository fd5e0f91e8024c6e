"""The producer's bulk socket: payload bytes sealed per transfer (`served.seal`), off CURVE, on plain TCP.

The side channel (CURVE) hands a transfer over with `offer()`: it waits, under its session id, for the
consumer to pull it on this plain TCP port with the session's proof (the wire: `served.bulk_wire`).

A connection whose first PULL_BYTES are not a pull of an offered session with a valid proof (or that
sends none within STRANGER_WAIT_S) is refused (counted, logged rate-limited) and closed with nothing
written; what such strangers may cost is `served.bulk_door`'s. A pull is served once: replayed, it
finds nothing. A transfer not pulled within PULL_WAIT_S is dropped (its payload freed, as an expired one).

Not ZeroMQ, on purpose: a plain stream costs this host about half the CPU of libzmq's per byte (no I/O
thread between the Python thread and the kernel, the consumer reads straight into the payload's memory),
and on a small machine the CPU is what bounds a transfer. A worker thread streams each transfer: it
seals chunk k, hands it to the kernel and seals chunk k+1 while the consumer opens chunk k; its one
chunk buffer is reused, warm. A consumer that stops reading stalls only its own transfer and is
dropped after SEND_STALL_S. The payload's memory is released once its last chunk is sealed (with `none`:
once its last byte is in the kernel's hands).
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable

import msgpack
import numpy as np

from omni_mesh.connectors.errors import ConnectorError
from omni_mesh.connectors.served.bulk_door import BulkDoor
from omni_mesh.connectors.served.bulk_wire import (
    CHUNK_HEADER,
    IDLE_LINK_S,
    PULL,
    PULL_BYTES,
    tune,
    wait_limit,
)
from omni_mesh.connectors.served.seal import (
    NONE,
    SID_BYTES,
    TAG_BYTES,
    Sealer,
    Session,
    chunk_size,
    plan,
)
from omni_mesh.ports import WILDCARDS
from omni_mesh.security import Refusals

PULL_WAIT_S = 60.0  # a transfer offered but not pulled this long is dropped (its consumer is gone)
STRANGER_WAIT_S = 1.0  # a new connection must pull within this (a consumer pulls as it connects)
SEND_STALL_S = 10.0  # a consumer that takes no bytes for this long is dropped (its buffer freed)
LISTEN_BACKLOG = 1024  # connections the kernel completes before the door accepts them (capped: somaxconn)


class _Transfer:
    __slots__ = ("session", "sealer", "parts", "chunks", "on_done", "expires")

    def __init__(self, session: Session, parts: list, chunk: int, on_done: Callable[[], None]):
        self.session = session
        self.sealer: Sealer | None = None  # None: `none`, the parts are sent as they are (see offer)
        self.parts = parts
        self.chunks = plan([len(p) for p in parts], chunk)
        self.on_done: Callable[[], None] | None = on_done
        self.expires = time.monotonic() + PULL_WAIT_S

    def release(self) -> None:
        """Free the payload (once): its bytes are no longer read."""
        done, self.on_done, self.parts = self.on_done, None, []
        if done is not None:
            done()


def listening_socket(host: str, port: int) -> socket.socket:
    """A TCP socket listening on `host` (a wildcard: every interface) and `port` (0: any free one)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    address = {"*": "0.0.0.0"}.get(host, host) if host in WILDCARDS else host
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((address, port))
        sock.listen(LISTEN_BACKLOG)
    except BaseException:
        sock.close()
        raise
    return sock


class BulkServer:
    """A plain TCP port streaming offered transfers to consumers that prove their session."""

    def __init__(self, bind_host: str, owner: str, port: int = 0) -> None:
        self._bind = (bind_host, port)
        self._owner = owner
        self.refused = Refusals(f"{owner} bulk socket")
        self.pulled = 0  # transfers a consumer proved its session for (health: bulk_transfers)
        self._offered: dict[bytes, _Transfer] = {}  # by session id, until pulled
        self._lock = threading.Lock()  # the offered table, the counters
        self._buffers = threading.local()  # each streaming thread's chunk buffer, reused (warm)
        self._door: BulkDoor | None = None
        self.port = 0

    @property
    def error(self) -> BaseException | None:
        """Why the port's thread stopped, if it did (large payloads cannot leave)."""
        return self._door.error if self._door is not None else None

    def start(self) -> int:
        try:
            listener = listening_socket(*self._bind)
        except OSError as exc:
            raise ConnectorError(
                f"{self._owner}: cannot serve bulk bytes on {self._bind[0]}:{self._bind[1]}: {exc}; "
                "set `bulk_port` to a free port (0 picks any)"
            ) from None
        self.port = int(listener.getsockname()[1])
        self._door = BulkDoor(
            listener,
            self._owner,
            PULL_BYTES,
            (STRANGER_WAIT_S, IDLE_LINK_S),  # read now: tests shorten them
            self._claim,
            self._stream,
            self._refuse,
            self._expire,
        )
        self._door.start()
        return self.port

    def stop(self) -> None:
        if self._door is not None:
            self._door.stop()
        with self._lock:
            left, self._offered = list(self._offered.values()), {}
        for transfer in left:
            transfer.release()

    def offer(
        self, session: Session, algorithm: str, key: str, parts: list, on_done: Callable[[], None]
    ) -> bytes:
        """Hold `parts` (the payload's bytes, in order) for the consumer of `session`; the description
        the side channel answers with. `on_done` runs once the parts are no longer read."""
        chunk = chunk_size(sum(len(p) for p in parts))
        transfer = _Transfer(session, parts, chunk, on_done)
        if algorithm != NONE:
            transfer.sealer = Sealer(algorithm, session, key, len(transfer.chunks))
        with self._lock:  # a session offered twice (a consumer reusing its offer) keeps the last
            replaced = self._offered.pop(session.sid, None)
            self._offered[session.sid] = transfer
        if replaced is not None:
            replaced.release()
        return msgpack.packb({"a": algorithm, "p": self.port, "c": chunk, "l": [len(p) for p in parts]})

    def _refuse(self, what: str) -> None:
        with self._lock:
            self.refused.refuse(what)

    def _expire(self, now: float) -> None:
        with self._lock:
            gone = [sid for sid, t in self._offered.items() if t.expires <= now]
            dropped = [self._offered.pop(sid) for sid in gone]
        for transfer in dropped:
            transfer.release()

    # ---------------------------------------------------------------- one transfer (the door calls these)

    def _claim(self, pull: bytes) -> _Transfer | None:
        if pull[: len(PULL)] != PULL:
            return None
        sid, proof = pull[len(PULL) : len(PULL) + SID_BYTES], pull[len(PULL) + SID_BYTES :]
        with self._lock:
            transfer = self._offered.get(sid)
            if transfer is None or not transfer.session.proves(proof):
                return None
            del self._offered[sid]  # served once: a replayed pull finds nothing
            self.pulled += 1
        return transfer

    def _stream(self, conn: socket.socket, transfer: _Transfer) -> None:
        """Every chunk of `transfer`, in order (sealed into this thread's buffer first)."""
        sid, sealer, last = transfer.session.sid, transfer.sealer, len(transfer.chunks) - 1
        buffer: np.ndarray | None = getattr(self._buffers, "buffer", None)
        tune(conn)
        wait_limit(conn, socket.SO_SNDTIMEO, SEND_STALL_S)
        try:
            for index, (part, offset, length) in enumerate(transfer.chunks):
                data = memoryview(transfer.parts[part])[offset : offset + length]
                if sealer is None:
                    body = data
                else:
                    if buffer is None or len(buffer) < length + TAG_BYTES:
                        buffer = self._buffers.buffer = np.empty(length + TAG_BYTES, np.uint8)
                    body = memoryview(buffer)[: length + TAG_BYTES]
                    sealer.seal_into(index, part, offset, data, body)
                    if index == last:
                        transfer.release()  # every byte is sealed: the payload's memory goes back now
                conn.sendall(CHUNK_HEADER.pack(sid, index, len(body)), socket.MSG_MORE)
                conn.sendall(body)
        finally:
            transfer.release()
