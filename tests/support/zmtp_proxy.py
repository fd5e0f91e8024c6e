"""A TCP proxy that understands ZMTP 3 framing (NULL mechanism) and alters what a server sends back.

It sits between a consumer's DEALER and a producer's plain bulk socket (both real) and, from the
`after`-th message of the server on, does one of:

- `flip`: flips one byte in the middle of the message's last frame;
- `replay`: sends the previous message again in its place, its first frame (the clear chunk id)
  rewritten to the one expected now, as an attacker replaying a chunk would;
- `cut`: closes both connections (the stream is cut short).

The client's bytes pass through untouched.
"""

from __future__ import annotations

import contextlib
import socket
import threading

_GREETING = 64


def _read(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        more = sock.recv(n - len(data))
        if not more:
            raise ConnectionError("closed")
        data += more
    return data


def _frame(sock: socket.socket) -> tuple[int, bytes]:
    flags = _read(sock, 1)[0]
    size = int.from_bytes(_read(sock, 8 if flags & 0x02 else 1), "big")
    return flags, _read(sock, size)


def _encode(flags: int, body: bytes) -> bytes:
    if len(body) > 255:
        return bytes([flags | 0x02]) + len(body).to_bytes(8, "big") + body
    return bytes([flags & ~0x02]) + len(body).to_bytes(1, "big") + body


class ZmtpProxy:
    def __init__(self, upstream_port: int, mode: str, after: int = 1) -> None:
        self.mode, self.after = mode, after
        self._upstream = upstream_port
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self.altered = threading.Event()
        self._sockets: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def close(self) -> None:
        for sock in (self._listener, *self._sockets):
            with contextlib.suppress(OSError):
                sock.close()

    def _accept(self) -> None:
        with contextlib.suppress(OSError):
            while True:
                client, _ = self._listener.accept()
                server = socket.create_connection(("127.0.0.1", self._upstream))
                self._sockets += [client, server]
                threading.Thread(target=self._pipe, args=(client, server), daemon=True).start()
                threading.Thread(target=self._alter, args=(server, client), daemon=True).start()

    @staticmethod
    def _pipe(source: socket.socket, sink: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := source.recv(1 << 16):
                sink.sendall(data)

    def _alter(self, server: socket.socket, client: socket.socket) -> None:
        with contextlib.suppress(OSError, ConnectionError):
            left = _GREETING  # forwarded as it comes: each side sends its rest once it saw the other's start
            while left:
                piece = server.recv(left)
                if not piece:
                    return
                client.sendall(piece)
                left -= len(piece)
            messages, current, previous = 0, [], None
            while True:
                flags, body = _frame(server)
                if flags & 0x04:  # a command (READY, PING): as it is
                    client.sendall(_encode(flags, body))
                    continue
                current.append((flags, body))
                if flags & 0x01:  # more frames of this message follow
                    continue
                message, current = current, []
                if messages >= self.after and not self.altered.is_set():
                    message = self._change(message, previous)
                    if message is None:
                        server.close()
                        client.close()
                        return
                previous = message
                messages += 1
                client.sendall(b"".join(_encode(f, b) for f, b in message))

    def _change(self, message: list, previous: list | None) -> list | None:
        self.altered.set()
        if self.mode == "cut":
            return None
        if self.mode == "replay" and previous is not None:
            return [message[0], *previous[1:]]  # the chunk id expected now, an earlier chunk's bytes
        flags, body = message[-1]
        flipped = bytearray(body)
        flipped[len(flipped) // 2] ^= 0x01
        return [*message[:-1], (flags, bytes(flipped))]
