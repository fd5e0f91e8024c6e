"""Control-plane messages: msgpack maps over ZeroMQ multipart, never pickle.

Every message is one msgpack map with a "type"; a message that carries a payload inline (a final
stage's output) adds one more ZeroMQ frame holding a codec frame. Stage replicas talk to the
coordinator over one DEALER socket each; the coordinator binds a ROUTER. Payloads between stages never
travel here: only the connector metadata that locates them.

Stage -> coordinator
    register    stage, replica, pid, host, pidns, ipcns, shm_prefix, max_inflight, edges {label: connector},
                connectors {ref: health}
    heartbeat   replica, inflight, processed, errors, connectors {ref: health}, draining
    output      rid, stage, replica, edges {dst: {key, meta}}, seq, last, timings; + frame if final
    error       rid, stage, replica, error, timeout (true: the request's deadline passed in the stage)
    deregister  replica
Coordinator -> stage
    registered  replica, heartbeat_s
    work        rid, stage, inputs | sources {src: [{key, meta}]}, stream_from, params, remaining_s
    chunk       rid, src, key, meta, seq, last       (the next streamed chunk of an accepted request)
    abort       rid, reason
    drained     replica                              (draining, and every request it took part in has ended)
"""

from __future__ import annotations

from typing import Any

import msgpack

# Message types and the fields each must carry, with their types. Anything else is dropped and counted.
SCHEMA: dict[str, dict[str, type | tuple[type, ...]]] = {
    "register": {"stage": str, "replica": str, "pid": int, "host": str, "max_inflight": int, "edges": dict},
    "heartbeat": {"replica": str, "inflight": int},
    "output": {"rid": str, "stage": str, "replica": str, "edges": dict, "seq": int, "last": bool},
    "error": {"rid": str, "stage": str, "replica": str, "error": str},
    "deregister": {"replica": str},
    "registered": {"replica": str, "heartbeat_s": (int, float)},
    "rejected": {"replica": str, "error": str},
    "work": {"rid": str, "stage": str, "params": dict, "remaining_s": (int, float)},
    "chunk": {"rid": str, "src": str, "key": str, "seq": int, "last": bool},
    "abort": {"rid": str, "reason": str},
    "drained": {"replica": str},
}

MAX_MESSAGE_BYTES = 1 << 20  # metadata only: anything larger is a bug or an attack


class MalformedMessage(ValueError):
    """A control message that does not follow SCHEMA."""


def pack(message: dict[str, Any]) -> bytes:
    return msgpack.packb(message, use_bin_type=True)


def unpack(raw: bytes | memoryview) -> dict[str, Any]:
    """Decode and check one message; raises MalformedMessage with the reason."""
    if len(raw) > MAX_MESSAGE_BYTES:
        raise MalformedMessage(f"control message of {len(raw)} bytes exceeds {MAX_MESSAGE_BYTES}")
    try:
        message = msgpack.unpackb(raw, raw=False, strict_map_key=False)
    except Exception as exc:
        raise MalformedMessage(f"undecodable control message: {exc}") from None
    if not isinstance(message, dict):
        raise MalformedMessage(f"control message is a {type(message).__name__}, not a map")
    kind = message.get("type")
    fields = SCHEMA.get(kind) if isinstance(kind, str) else None
    if fields is None:
        raise MalformedMessage(f"unknown control message type {kind!r}")
    for name, expected in fields.items():
        value = message.get(name)
        if not isinstance(value, expected) or (expected is int and isinstance(value, bool)):
            raise MalformedMessage(f"{kind} message: field {name!r} missing or not {_names(expected)}")
    return message


def _names(expected: type | tuple[type, ...]) -> str:
    types = expected if isinstance(expected, tuple) else (expected,)
    return " or ".join(t.__name__ for t in types)
