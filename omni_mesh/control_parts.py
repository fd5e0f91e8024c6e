"""Several control messages in one ZeroMQ multipart message (a replica to its coordinator).

A replica's running batch makes a token for each of its requests every step, and a final stage sends
each one to the coordinator as an output message of its own: at 16 requests, 16 sends per step, each a
wake-up of ZeroMQ's I/O thread, an encrypted box and a receive on the other side. Messages sent in the
same turn of the event loop go in one multipart message instead (omni_mesh.stage.outgoing).

The parts: a lone message, and its frame if it has one (`[message]`, `[message, frame]`: the form every
message had before batching); for several, one part, a bundle (`BUNDLE`, then each message and its
frame, each pair after their two lengths), as long as their frames are small: sent as parts of their own,
each part is a send of its own, and each send hands the stage's GIL over to its batch thread (which
takes it, one torch op at a time: a step's 16 messages and frames cost the event loop ~30 hand-overs and
back); with a large frame among them, each message followed by its frame, an empty part where it has
none (`[m1, f1, m2, b"", ...]`: a large frame is not copied). A codec frame is never empty.
"""

from __future__ import annotations

import struct
from typing import Any

#: The most messages one multipart carries (the rest go in the next).
MAX_MESSAGES = 256
#: A bundle's first byte (a packed control message is a msgpack map: it never starts with it).
BUNDLE = b"\x00"
#: Messages and frames of at most this many bytes in all go in a bundle (copied into it once, as ZeroMQ
#: copies parts this small anyway).
BUNDLE_BYTES = 64 * 1024
_LENGTHS = struct.Struct("<II")  # a bundled message's length, its frame's (0: none)


def join(messages: list[tuple[bytes, Any]]) -> list[Any]:
    """Packed messages, each with its frame or None, as the parts of one multipart message."""
    if len(messages) == 1:
        packed, frame = messages[0]
        return [packed] if frame is None else [packed, frame]
    if sum(len(packed) + (0 if frame is None else len(frame)) for packed, frame in messages) <= BUNDLE_BYTES:
        pieces: list[Any] = [BUNDLE]
        for packed, frame in messages:
            frame = b"" if frame is None else frame
            pieces += (_LENGTHS.pack(len(packed), len(frame)), packed, frame)
        return [b"".join(pieces)]
    parts: list[Any] = []
    for packed, frame in messages:
        parts.append(packed)
        parts.append(b"" if frame is None else frame)
    return parts


def split(parts: list[Any]) -> list[tuple[Any, Any]]:
    """The (message, frame or None) pairs of a multipart message's parts (`join`'s inverse): whatever the
    parts are (bytes, or zmq Frames), or memoryviews into a bundle. ValueError for an odd count past one,
    or a bundle cut short."""
    if len(parts) == 1:
        whole = parts[0].buffer if hasattr(parts[0], "buffer") else memoryview(parts[0])
        return _unbundle(whole) if whole[:1] == BUNDLE else [(parts[0], None)]
    if len(parts) % 2:
        raise ValueError(f"{len(parts)} parts: not messages paired with their frames")
    return [(parts[i], parts[i + 1] if len(parts[i + 1]) else None) for i in range(0, len(parts), 2)]


def _unbundle(whole: memoryview) -> list[tuple[memoryview, memoryview | None]]:
    """A bundle's (message, frame or None) pairs, views into it."""
    out, at, end = [], 1, len(whole)
    while at < end:
        if at + _LENGTHS.size > end:
            raise ValueError("a bundle cut short in a message's lengths")
        size, frame_size = _LENGTHS.unpack_from(whole, at)
        at += _LENGTHS.size
        if at + size + frame_size > end:
            raise ValueError(
                f"a bundle cut short: a message of {size} bytes and a frame of {frame_size} past its end"
            )
        out.append((whole[at : at + size], whole[at + size : at + size + frame_size] if frame_size else None))
        at += size + frame_size
    return out
