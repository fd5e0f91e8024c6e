"""Several control messages in one ZeroMQ multipart message (a replica to its coordinator).

A replica's running batch makes a token for each of its requests every step, and a final stage sends
each one to the coordinator as an output message of its own: at 16 requests, 16 sends per step, each a
wake-up of ZeroMQ's I/O thread, an encrypted box and a receive on the other side. Messages sent in the
same turn of the event loop go in one multipart message instead (omni_mesh.stage.outgoing).

The parts: a lone message, and its frame if it has one (`[message]`, `[message, frame]`: the form every
message had before batching); or, for several, each message followed by its frame, an empty part where
it has none (`[m1, f1, m2, b"", ...]`). A codec frame is never empty.
"""

from __future__ import annotations

from typing import Any

#: The most messages one multipart carries (the rest go in the next).
MAX_MESSAGES = 256


def join(messages: list[tuple[bytes, Any]]) -> list[Any]:
    """Packed messages, each with its frame or None, as the parts of one multipart message."""
    if len(messages) == 1:
        packed, frame = messages[0]
        return [packed] if frame is None else [packed, frame]
    parts: list[Any] = []
    for packed, frame in messages:
        parts.append(packed)
        parts.append(b"" if frame is None else frame)
    return parts


def split(parts: list[Any]) -> list[tuple[Any, Any]]:
    """The (message, frame or None) pairs of a multipart message's parts (`join`'s inverse); a frame is
    whatever the parts are (bytes, or zmq Frames). ValueError for an odd count past one."""
    if len(parts) == 1:
        return [(parts[0], None)]
    if len(parts) % 2:
        raise ValueError(f"{len(parts)} parts: not messages paired with their frames")
    return [(parts[i], parts[i + 1] if len(parts[i + 1]) else None) for i in range(0, len(parts), 2)]
