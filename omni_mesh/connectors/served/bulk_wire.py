"""The bulk socket's wire format, what both ends import: a consumer's PULL, the producer's chunks, and
the socket options and exact receives both sides use (`served.bulk_server` streams, `served.bulk_client`
pulls; sealing is `served.seal`'s).

    consumer -> PULL: b"OMB1" sid(16) proof(32)                      (PULL_BYTES)
    producer -> per chunk: CHUNK_HEADER (sid, index, body length), then the body (sealed: + 16-byte tag)
    ... the connection stays open for the consumer's next pull (IDLE_LINK_S)
"""

from __future__ import annotations

import socket
import struct
import time

from omni_mesh.connectors.served.seal import SID_BYTES

PULL = b"OMB1"
PULL_BYTES = len(PULL) + SID_BYTES + 32  # + the proof, an HMAC-SHA256
CHUNK_HEADER = struct.Struct(">16sII")  # the transfer's sid, the chunk's index, the body's length
IDLE_LINK_S = 120.0  # a proven connection may wait this long for its next pull (consumers pool them)
#: Kernel socket buffers of a bulk connection: larger than the default start, so the kernel moves a
#: chunk in a few large steps instead of waking both sides per 64 KiB.
SOCKET_BUFFER_BYTES = 1 << 20


def tune(sock: socket.socket) -> None:
    """A bulk connection's options: no Nagle delay for the last bytes of a chunk, larger buffers."""
    sock.settimeout(None)  # blocking; deadlines are SO_RCVTIMEO / SO_SNDTIMEO (see `wait_limit`)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER_BYTES)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER_BYTES)


def wait_limit(sock: socket.socket, option: int, seconds: float) -> None:
    """How long one blocking receive (SO_RCVTIMEO) or send (SO_SNDTIMEO) of `sock` may wait."""
    whole = int(seconds)
    sock.setsockopt(socket.SOL_SOCKET, option, struct.pack("ll", whole, int((seconds - whole) * 1e6)))


def recv_exactly(sock: socket.socket, view: memoryview, deadline: float) -> int:
    """Fill `view` from `sock` (MSG_WAITALL: one wake-up when it is all there); the bytes received
    before the peer closed or `deadline` (monotonic: for all of it) passed, if fewer."""
    got, size = 0, len(view)
    while got < size:
        left = deadline - time.monotonic()  # a peer sending a byte now and then must not restart the wait
        if left <= 0:
            return got
        wait_limit(sock, socket.SO_RCVTIMEO, max(0.001, left))  # 0 would mean: wait forever
        try:
            n = sock.recv_into(view[got:], size - got, socket.MSG_WAITALL)
        except (BlockingIOError, InterruptedError):  # SO_RCVTIMEO passed
            return got
        if n == 0:
            return got
        got += n
    return got
