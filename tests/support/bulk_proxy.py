"""A TCP proxy that understands the bulk stream's framing and alters what the producer sends back.

It sits between a consumer and a producer's bulk port (both real). The consumer's bytes (its pulls)
pass through untouched; the producer's are read chunk by chunk (`bulk_wire.CHUNK_HEADER`: sid,
index, body length; then the body) and, from the `after`-th chunk of a connection on, the first one
is (once, across all connections):

- `flip`: sent with one byte in the middle of its body flipped;
- `replay`: replaced by the previous chunk's body under the header expected now (the index
  rewritten), as an attacker replaying a chunk would;
- `cut`: not sent: both connections are closed (the stream is cut short);
- `trickle`: sent, with all that follows on its connection, a few hundred bytes at a time (a path
  so congested that the stream, never cut, would take hours).

It serves any number of connections (a consumer may open more than one) and chunks of any size.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time

from omni_mesh.connectors.served.bulk_wire import CHUNK_HEADER

MODES = ("flip", "replay", "cut", "trickle")
TRICKLE_BYTES, TRICKLE_PAUSE_S = 512, 0.05  # about 10 KB/s


def _read_into(sock: socket.socket, view: memoryview) -> bool:
    """Fill `view` from `sock`; False if the connection closed first (with nothing, or mid-way)."""
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if not n:
            return False
        got += n
    return True


class BulkProxy:
    def __init__(self, upstream_port: int, mode: str, after: int = 1) -> None:
        if mode not in MODES:
            raise ValueError(f"BulkProxy mode must be one of {MODES}, not {mode!r}")
        self.mode, self.after = mode, after
        self._upstream = upstream_port
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self.altered = threading.Event()
        self._lock = threading.Lock()  # `altered` is tested and set by several connections' threads
        self._sockets: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def close(self) -> None:
        with self._lock:
            sockets = [self._listener, *self._sockets]
        for sock in sockets:
            _close(sock)

    def _accept(self) -> None:
        with contextlib.suppress(OSError):
            while True:
                client, _ = self._listener.accept()
                server = socket.create_connection(("127.0.0.1", self._upstream))
                with self._lock:
                    self._sockets += [client, server]
                threading.Thread(target=self._pipe, args=(client, server), daemon=True).start()
                threading.Thread(target=self._alter, args=(server, client), daemon=True).start()

    @staticmethod
    def _pipe(client: socket.socket, server: socket.socket) -> None:
        """The consumer's bytes, as they are; its close closes the producer's side too."""
        with contextlib.suppress(OSError):
            while data := client.recv(1 << 16):
                server.sendall(data)
        _close(server)
        _close(client)

    def _alter(self, server: socket.socket, client: socket.socket) -> None:
        header = bytearray(CHUNK_HEADER.size)
        body = bytearray()
        previous: bytes | None = None  # the last body sent on this connection
        chunks = 0
        with contextlib.suppress(OSError):
            while _read_into(server, memoryview(header)):
                sid, index, length = CHUNK_HEADER.unpack(header)
                if len(body) < length:
                    body = bytearray(length)
                view = memoryview(body)[:length]
                if not _read_into(server, view):
                    break  # the producer closed mid-chunk: so does the consumer's side (below)
                out_header, out_body = bytes(header), view
                if chunks >= self.after and self._take_turn():
                    if self.mode == "cut":
                        break
                    if self.mode == "trickle":
                        self._trickle(server, client, bytes(header) + bytes(view))
                        break
                    if self.mode == "replay" and previous is not None:
                        out_body = memoryview(previous)  # an earlier chunk under the index expected now
                        out_header = CHUNK_HEADER.pack(sid, index, len(previous))
                    elif length:
                        view[length // 2] ^= 0x01
                chunks += 1
                client.sendall(out_header)
                client.sendall(out_body)
                previous = bytes(out_body) if self.mode == "replay" else None  # only replay needs a copy
        _close(server)
        _close(client)

    @staticmethod
    def _trickle(server: socket.socket, client: socket.socket, data: bytes) -> None:
        """`data` and the rest of what the producer sends, slowly, until either side closes."""
        while data:
            for start in range(0, len(data), TRICKLE_BYTES):
                client.sendall(data[start : start + TRICKLE_BYTES])
                time.sleep(TRICKLE_PAUSE_S)
            data = server.recv(1 << 16)

    def _take_turn(self) -> bool:
        """Whether this chunk is the one altered (the first from `after` on, of all connections)."""
        with self._lock:
            if self.altered.is_set():
                return False
            self.altered.set()
            return True


def _close(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)  # wakes a thread blocked in recv on it
    with contextlib.suppress(OSError):
        sock.close()
