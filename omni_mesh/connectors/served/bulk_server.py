"""The producer's bulk socket: payload bytes sealed per transfer (`served.seal`), off CURVE.

The side channel (CURVE) hands a transfer over with `offer()`: it waits, under its session id, for
the consumer to pull it on this plain ROUTER socket with the session's proof. A pull without a valid
proof is refused (counted, logged rate-limited) and answered with nothing: a stranger who connects
here learns nothing and makes nothing be written. A transfer not pulled within `PULL_WAIT_S` is
dropped (its payload freed, as an expired one).

One thread serves every transfer, round-robin: it seals the next chunk of each into a buffer of a small
reused pool and queues it zero-copy; libzmq's I/O thread writes it while the next one is sealed, and
the consumer opens chunk k while chunk k+1 is on the wire. A buffer is reused once libzmq let go of
it, so a slow consumer holds a few megabytes, never a copy of its payload. The payload's own memory
is released once its last chunk is sealed (with `none`: once its parts have been sent from it).
"""

from __future__ import annotations

import collections
import contextlib
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import msgpack
import numpy as np
import zmq

from omni_mesh.connectors._addresses import tcp_endpoint
from omni_mesh.connectors.base import ConnectorError
from omni_mesh.connectors.served.seal import (
    MAX_CHUNK_BYTES,
    NONE,
    TAG_BYTES,
    Sealer,
    Session,
    chunk_id,
    chunk_size,
    plan,
)
from omni_mesh.security import Refusals

log = logging.getLogger("omni_mesh.connectors")

PULL = b"PULL"
PULL_WAIT_S = 60.0  # a transfer offered but not pulled this long is dropped (its consumer is gone)
BUFFERS = 16  # sealed chunks in flight, all transfers together (each up to MAX_CHUNK_BYTES: touched as used)
PER_TRANSFER = 4  # ... of one transfer: a consumer that stops reading holds no more than these
HEARTBEAT_IVL_MS, HEARTBEAT_TIMEOUT_MS = 1000, 10_000  # a frozen consumer is dropped (its buffers freed)
_MAX_REQUEST_BYTES = 256  # a pull is 4 + 16 + 32 bytes: anything larger is not one of ours
_IDLE_POLL_MS = 50


class _Transfer:
    __slots__ = (
        "session",
        "sealer",
        "parts",
        "chunks",
        "next",
        "identity",
        "pending",
        "trackers",
        "on_done",
        "expires",
    )

    def __init__(
        self, session: Session, sealer: Sealer | None, parts: list, chunk: int, on_done: Callable[[], None]
    ):
        self.session = session
        self.sealer = sealer  # None: `none`, the parts are sent as they are
        self.parts = parts
        self.chunks = plan([len(p) for p in parts], chunk)
        self.next = 0  # the next chunk to seal (or part to send)
        self.identity = b""
        self.pending: tuple[bytes, Any, bytearray | None] | None = (
            None  # sealed, not yet queued (socket full)
        )
        self.trackers: list[zmq.MessageTracker] = []  # `none`: parts libzmq may still send from
        self.on_done: Callable[[], None] | None = on_done
        self.expires = time.monotonic() + PULL_WAIT_S

    def release(self) -> None:
        """Free the payload (once): its bytes are no longer read."""
        done, self.on_done, self.parts = self.on_done, None, []
        if done is not None:
            done()


class BulkServer:
    """A plain ROUTER socket streaming offered transfers to consumers that prove their session."""

    def __init__(self, ctx: zmq.Context, bind_host: str, owner: str, port: int = 0) -> None:
        self._ctx = ctx
        self._bind = tcp_endpoint(bind_host, port or "*")
        self._owner = owner
        self.refused = Refusals(f"{owner} bulk socket")
        self.pulled = 0  # transfers a consumer proved its session for (health: bulk_transfers)
        self._offered: dict[bytes, _Transfer] = {}  # by session id, until pulled
        self._offered_lock = threading.Lock()
        self._active: collections.deque[_Transfer] = collections.deque()
        self._free: list[np.ndarray] = []
        self._busy: list[tuple[zmq.MessageTracker, np.ndarray]] = []
        self._made = 0
        self._stop = threading.Event()
        self._ready = threading.Event()
        self.port = 0
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=f"{owner}-bulk", daemon=True)

    def start(self) -> int:
        self._thread.start()
        self._ready.wait(10)
        if self.error is not None or not self.port:
            raise ConnectorError(
                f"{self._owner}: cannot serve bulk bytes on {self._bind}: {self.error or 'bind timed out'}; "
                "set `bulk_port` to a free port (0 picks any)"
            )
        return self.port

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(5)
        with self._offered_lock:
            left, self._offered = list(self._offered.values()), {}
        for transfer in left:
            transfer.release()

    def offer(
        self, session: Session, algorithm: str, key: str, parts: list, on_done: Callable[[], None]
    ) -> bytes:
        """Hold `parts` (the payload's bytes, in order) for the consumer of `session`; the description
        the side channel answers with. `on_done` runs once the parts are no longer read."""
        chunk = chunk_size(sum(len(p) for p in parts))
        transfer = _Transfer(session, None, parts, chunk, on_done)
        if algorithm != NONE:
            transfer.sealer = Sealer(algorithm, session, key, len(transfer.chunks))
        with self._offered_lock:  # a session offered twice (a consumer reusing its offer) keeps the last
            replaced = self._offered.pop(session.sid, None)
            self._offered[session.sid] = transfer
        if replaced is not None:
            replaced.release()
        return msgpack.packb({"a": algorithm, "p": self.port, "c": chunk, "l": [len(p) for p in parts]})

    # ---------------------------------------------------------------- the thread

    def _run(self) -> None:
        sock = self._ctx.socket(zmq.ROUTER)
        try:
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.MAXMSGSIZE, _MAX_REQUEST_BYTES)
            sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a gone consumer is an error, not a silent drop
            # Flow control is the buffers' (with `none`, the parts are the payload's own memory).
            sock.setsockopt(zmq.SNDHWM, 0)
            sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
            sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
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
            for transfer in self._active:
                transfer.release()
            sock.close(linger=0)

    def _serve(self, sock: zmq.Socket) -> None:
        next_expiry = time.monotonic()
        while not self._stop.is_set():
            moved = self._pump(sock)
            if not moved and self._active and self._busy:  # every transfer waits for a buffer
                with contextlib.suppress(zmq.NotDone):
                    self._busy[0][0].wait(0.002)  # the oldest: usually the first let go of
            if sock.poll(0 if self._active else _IDLE_POLL_MS, zmq.POLLIN):
                for _ in range(64):
                    try:
                        request = sock.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self._pull(request)
            now = time.monotonic()
            if now >= next_expiry:
                next_expiry = now + 0.5
                self._expire(now)

    def _pull(self, request: list[bytes]) -> None:
        if len(request) != 4 or request[1] != PULL:
            self.refused.refuse("a message that is not a pull")
            return
        identity, _, sid, proof = request
        with self._offered_lock:
            transfer = self._offered.get(sid)
            if transfer is not None and transfer.session.proves(proof):
                del self._offered[sid]  # served once: a replayed pull finds nothing
            else:
                transfer = None
        if transfer is None:
            self.refused.refuse("a pull without a valid session proof (a stranger, or a replay)")
            return
        transfer.identity = identity
        self.pulled += 1
        self._active.append(transfer)

    def _expire(self, now: float) -> None:
        with self._offered_lock:
            gone = [sid for sid, t in self._offered.items() if t.expires <= now]
            dropped = [self._offered.pop(sid) for sid in gone]
        for transfer in dropped:
            transfer.release()

    def _buffer(self) -> np.ndarray | None:
        if not self._free and self._busy:  # those libzmq let go of (any order: consumers differ in speed)
            busy, self._busy = self._busy, []
            for tracker, buffer in busy:
                if tracker.done:
                    self._free.append(buffer)
                else:
                    self._busy.append((tracker, buffer))
        if self._free:
            return self._free.pop()
        if self._made < BUFFERS:
            self._made += 1
            return np.empty(MAX_CHUNK_BYTES + TAG_BYTES, np.uint8)  # faulted in as used, then reused warm
        return None

    def _pump(self, sock: zmq.Socket) -> bool:
        """Queue what each active transfer can send now; whether anything moved."""
        moved = False
        for _ in range(len(self._active)):
            transfer = self._active.popleft()
            try:
                moved |= self._advance(sock, transfer)
            except zmq.ZMQError:  # the consumer is gone (EHOSTUNREACH): what it would have had is dropped
                transfer.release()
                continue
            except Exception:  # one transfer's failure must not stop the others: its consumer times out
                log.exception("%s: a transfer failed on the bulk socket; it is dropped", self._owner)
                transfer.release()
                continue
            if transfer.pending is not None or transfer.next < len(transfer.chunks):
                self._active.append(transfer)
            elif transfer.sealer is None and not all(t.done for t in transfer.trackers):
                self._active.append(transfer)  # `none`: the parts are read until libzmq lets go
            else:
                transfer.release()
        return moved

    def _advance(self, sock: zmq.Socket, transfer: _Transfer) -> bool:
        """Seal and queue chunks of `transfer` (up to 4 per turn, so transfers share the thread)."""
        moved = False
        for _ in range(4):
            if transfer.pending is None:
                if transfer.next >= len(transfer.chunks):
                    break
                index = transfer.next
                part, offset, length = transfer.chunks[index]
                data = memoryview(transfer.parts[part])[offset : offset + length]
                if transfer.sealer is None:
                    transfer.pending = (chunk_id(transfer.session.sid, index), data, None)
                else:
                    transfer.trackers = [t for t in transfer.trackers if not t.done]
                    buffer = self._buffer() if len(transfer.trackers) < PER_TRANSFER else None
                    if buffer is None:
                        break
                    out = memoryview(buffer)[: length + TAG_BYTES]
                    transfer.sealer.seal_into(index, part, offset, data, out)
                    transfer.pending = (chunk_id(transfer.session.sid, index), out, buffer)
                transfer.next += 1
                if transfer.sealer is not None and transfer.next == len(transfer.chunks):
                    transfer.release()  # every byte is sealed: the payload's memory goes back now
            header, body, buffer = transfer.pending
            try:
                tracker = sock.send_multipart(
                    [transfer.identity, header, body], zmq.NOBLOCK, copy=False, track=True
                )
            except zmq.Again:
                break
            except zmq.ZMQError:
                if buffer is not None:
                    self._free.append(buffer)
                transfer.pending = None
                raise
            transfer.pending = None
            moved = True
            if buffer is not None:
                self._busy.append((tracker, buffer))
            transfer.trackers.append(tracker)  # `none`: the parts it reads; sealed: its buffers in flight
        return moved
