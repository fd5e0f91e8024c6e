"""The consumer's side of a sealed transfer (`served.seal`, `served.bulk_server`).

`pull()` proves the session on the producer's bulk socket and opens each chunk, as it arrives, straight
into the payload's buffers (OpenSSL writes there: no copy beside the decryption), checking that it is
the chunk expected next of this transfer. With `none` each chunk is copied there as it arrives (into
memory that comes back warm, where one large message would take fresh pages). Any chunk that is not
what it must be stops the transfer with a `BulkError` saying which and why: the caller never sees
bytes that failed their check.
"""

from __future__ import annotations

from typing import Any

import msgpack
import numpy as np
import zmq

from omni_mesh.connectors.served.bulk_server import PULL
from omni_mesh.connectors.served.dealers import DealerPool
from omni_mesh.connectors.served.seal import (
    CHOICES,
    NONE,
    TAG_BYTES,
    Sealer,
    SealError,
    Session,
    chunk_id,
    plan,
)

_ALIGN = 64  # each part starts 64-byte aligned, as the codec expects of large leaves


class BulkError(Exception):
    """A transfer's chunk was refused (tampered, replayed, reordered, cut short) or it made no sense."""


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
    comes back warm for the next one of its size, as libzmq's messages of the plain path do."""
    starts, total = [], 0
    for length in lengths:
        starts.append(total)
        total += -(-length // _ALIGN) * _ALIGN
    block = np.empty(total + _ALIGN, np.uint8)
    base = -block.ctypes.data % _ALIGN
    view = memoryview(block)[base:]
    return [view[start : start + length] for start, length in zip(starts, lengths, strict=True)]


def pull(
    pool: DealerPool, endpoint: str, session: Session, key: str, desc: bytes, timeout_s: float
) -> list[Any]:
    """The transfer's parts (buffers, in order), pulled from the bulk socket of the producer at
    `endpoint` (its side channel: same host). BulkError for a refused chunk; the pool's errors
    (TimeoutError, PeerLost, ChannelClosed) when the stream stops."""
    algorithm, port, chunk, lengths = describe(desc)
    host = endpoint.rsplit(":", 1)[0]
    chunks = plan(lengths, chunk)
    parts: list[Any] = _buffers(lengths)
    sealer = None if algorithm == NONE else Sealer(algorithm, session, key, len(chunks))
    received = 0

    def take(message: list[zmq.Frame]) -> bool:
        nonlocal received
        index = received
        part, offset, length = chunks[index]
        if len(message) != 2 or message[0].bytes != chunk_id(session.sid, index):
            raise BulkError(f"chunk {index} of {len(chunks)} is missing or out of order (another arrived)")
        body = message[1].buffer
        if sealer is None:  # copied as it arrives, like opening: no fresh allocation per message
            if len(body) != length:
                raise BulkError(f"chunk {index} of {len(chunks)} came with {len(body)} bytes, not {length}")
            parts[part][offset : offset + length] = body
        else:
            if len(body) != length + TAG_BYTES:
                raise BulkError(
                    f"chunk {index} of {len(chunks)} came with {len(body)} bytes, not {length + TAG_BYTES}"
                )
            try:
                sealer.open_into(index, part, offset, body, parts[part][offset : offset + length])
            except SealError:
                raise BulkError(
                    f"chunk {index} of {len(chunks)} failed authentication (altered, replayed, reordered or "
                    f"from another transfer in transit)"
                ) from None
        received += 1
        return received == len(chunks)

    if chunks:
        pool.stream(f"{host}:{port}", [PULL, session.sid, session.proof()], timeout_s, take)
    return parts
