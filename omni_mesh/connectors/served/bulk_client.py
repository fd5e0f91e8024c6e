"""The consumer's side of a sealed transfer (`served.seal`, `served.bulk_server`).

`pull()` proves the session on the producer's bulk port and reads each chunk as it arrives: sealed, into
a reused (warm) buffer it is opened from, straight into the payload's memory (OpenSSL writes there);
with `none`, straight into the payload's memory (the kernel's copy is the only one). It checks that each
chunk is the one expected next of this transfer. Any chunk that is not what it must be stops the
transfer with a `BulkError` saying which and why: the caller never sees bytes that failed their check.
A stream that stops early is a `StreamCut` (the producer is gone or the path was cut); one that stays
silent past the deadline a TimeoutError.

`BulkLinks` keeps the connections to each producer's bulk port between transfers (a TCP handshake per
payload would cost more than a small payload's bytes).
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import msgpack
import numpy as np

from omni_mesh.connectors.served.bulk_wire import CHUNK_HEADER, IDLE_LINK_S, PULL, recv_exactly, tune
from omni_mesh.connectors.served.dealers import ChannelClosed
from omni_mesh.connectors.served.seal import (
    CHOICES,
    NONE,
    TAG_BYTES,
    Sealer,
    SealError,
    Session,
    plan,
)

_ALIGN = 64  # each part starts 64-byte aligned, as the codec expects of large leaves
_IDLE_PER_PRODUCER = 4  # connections kept open to one producer between transfers
#: Connections one pull may take when each is closed unanswered (module docstring of served.bulk_door:
#: a flood of strangers from the consumer's own address pushes out the oldest unproven ones).
STALE_ATTEMPTS = 5


class BulkError(Exception):
    """A transfer's chunk was refused (tampered, replayed, reordered, cut short) or it made no sense."""


class StreamCut(ConnectionError):
    """The producer's stream ended (connection closed or reset) before the transfer's last byte."""


def describe(desc: bytes) -> tuple[str, int, int, list[int]]:
    """(algorithm, bulk port, chunk bytes, part lengths) of a producer's description; BulkError if odd."""
    try:
        fields = msgpack.unpackb(desc)
        algorithm, port, chunk, lengths = (
            fields["a"],
            int(fields["p"]),
            int(fields["c"]),
            [int(n) for n in fields["l"]],
        )
    except Exception as exc:  # noqa: BLE001 - any malformed description is one error
        raise BulkError(f"malformed transfer description ({type(exc).__name__})") from None
    if algorithm not in CHOICES or not 0 < port < 65536 or chunk <= 0 or any(n < 0 for n in lengths):
        raise BulkError(f"malformed transfer description {fields!r:.200}")
    return algorithm, port, chunk, lengths


def _buffers(lengths: list[int]) -> list[memoryview]:
    """One allocation for all parts, each 64-byte aligned. malloc's, on purpose: a payload's memory
    comes back warm for the next one of its size."""
    starts, total = [], 0
    for length in lengths:
        starts.append(total)
        total += -(-length // _ALIGN) * _ALIGN
    block = np.empty(total + _ALIGN, np.uint8)
    base = -block.ctypes.data % _ALIGN
    view = memoryview(block)[base:]
    return [view[start : start + length] for start, length in zip(starts, lengths, strict=True)]


def _host(endpoint: str) -> str:
    """The host of a side channel's endpoint (`tcp://H:P`, `tcp://[H6]:P`): the bulk port's host."""
    host = endpoint.removeprefix("tcp://").rsplit(":", 1)[0]
    return host[1:-1] if host.startswith("[") else host


class BulkLinks:
    """Connections to producers' bulk ports, kept between transfers (module docstring)."""

    def __init__(self) -> None:
        self._idle: dict[tuple[str, int], list[tuple[socket.socket, float]]] = {}
        self._busy: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._closed = False

    def stream(
        self, host: str, port: int, pull: bytes, deadline: float, read: Callable[[socket.socket], None]
    ) -> None:
        """Send `pull` to the producer at host:port and let `read` take the whole answer from the
        socket, by `deadline` (monotonic). A connection the producer closed before answering at all
        (a kept one it dropped meanwhile, or a fresh one its door closed in a flood of strangers: on a
        busy host the consumer's thread may not send its pull before the door's next turns push it out)
        is replaced by a fresh one, up to STALE_ATTEMPTS connections in all (the pull was not served: it
        still finds its transfer); any other failure propagates."""
        for attempt in range(STALE_ATTEMPTS):
            sock = self._checkout((host, port), deadline)
            try:
                try:
                    self.send_pull(sock, pull)
                except (BrokenPipeError, ConnectionResetError):
                    raise _Stale() from None
                read(sock)
            except _Stale:
                self._discard(sock)
                if attempt + 1 < STALE_ATTEMPTS and time.monotonic() < deadline:
                    continue
                raise StreamCut("the producer closed the connection before answering") from None
            except BaseException:
                self._discard(sock)
                if self._closed:
                    raise ChannelClosed() from None
                raise
            self._checkin((host, port), sock)
            return

    def send_pull(self, sock: socket.socket, pull: bytes) -> None:
        sock.sendall(pull)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            socks = [s for idle in self._idle.values() for s, _ in idle] + list(self._busy)
            self._idle, self._busy = {}, set()
        for sock in socks:  # wakes a transfer blocked on one of them
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()

    def _checkout(self, address: tuple[str, int], deadline: float) -> socket.socket:
        now = time.monotonic()
        with self._lock:
            if self._closed:
                raise ChannelClosed()
            idle = self._idle.get(address, [])
            while idle:
                sock, since = idle.pop()
                if now - since < IDLE_LINK_S / 2:  # well before the producer drops it
                    self._busy.add(sock)
                    return sock
                sock.close()
        sock = socket.create_connection(address, timeout=max(0.05, deadline - now))
        tune(sock)
        with self._lock:
            if self._closed:
                sock.close()
                raise ChannelClosed()
            self._busy.add(sock)
        return sock

    def _checkin(self, address: tuple[str, int], sock: socket.socket) -> None:
        with self._lock:
            self._busy.discard(sock)
            idle = self._idle.setdefault(address, [])
            if not self._closed and len(idle) < _IDLE_PER_PRODUCER:
                idle.append((sock, time.monotonic()))
                return
        sock.close()

    def _discard(self, sock: socket.socket) -> None:
        with self._lock:
            self._busy.discard(sock)
        sock.close()


class _Stale(Exception):
    """Not one byte of the answer came: the producer had closed the (kept) connection."""


def pull(
    links: BulkLinks, endpoint: str, session: Session, key: str, desc: bytes, timeout_s: float
) -> list[Any]:
    """The transfer's parts (buffers, in order), pulled from the bulk port of the producer at
    `endpoint` (its side channel: same host). BulkError for a refused chunk; StreamCut, TimeoutError,
    ChannelClosed or an OSError when the stream stops."""
    algorithm, port, chunk, lengths = describe(desc)
    chunks = plan(lengths, chunk)
    parts: list[Any] = _buffers(lengths)
    sealer = None if algorithm == NONE else Sealer(algorithm, session, key, len(chunks))
    scratch = memoryview(np.empty(chunk + TAG_BYTES, np.uint8)) if sealer is not None else None
    deadline = time.monotonic() + timeout_s
    header = memoryview(bytearray(CHUNK_HEADER.size))
    count = len(chunks)

    def receive(sock: socket.socket, view: memoryview, what: str, first: bool) -> None:
        try:
            got = recv_exactly(sock, view, deadline)  # a trickling stream must not outlast the deadline
        except ConnectionResetError:  # closed with our pull unread: reset, not ended
            if first:
                raise _Stale() from None
            raise
        if got == len(view):
            return
        if time.monotonic() >= deadline:
            raise TimeoutError(f"{what} did not come within {timeout_s:.3g}s")
        if first and got == 0:
            raise _Stale()
        raise StreamCut(f"the stream ended in {what}")

    def read(sock: socket.socket) -> None:
        for index, (part, offset, length) in enumerate(chunks):
            receive(sock, header, f"chunk {index} of {count}", index == 0)
            sid, got_index, size = CHUNK_HEADER.unpack(header)
            if sid != session.sid or got_index != index:
                raise BulkError(f"chunk {index} of {count} is missing or out of order (another arrived)")
            body = length + (TAG_BYTES if sealer is not None else 0)
            if size != body:
                raise BulkError(f"chunk {index} of {count} came with {size} bytes, not {body}")
            into = parts[part][offset : offset + length]
            if sealer is None:
                receive(sock, into, f"chunk {index} of {count}", False)
                continue
            sealed = scratch[:body]
            receive(sock, sealed, f"chunk {index} of {count}", False)
            try:
                sealer.open_into(index, part, offset, sealed, into)
            except SealError:
                raise BulkError(
                    f"chunk {index} of {count} failed authentication (altered, replayed, reordered or "
                    f"from another transfer in transit)"
                ) from None

    if chunks:
        links.stream(_host(endpoint), port, PULL + session.sid + session.proof(), deadline, read)
    return parts
