"""Control-plane messages: typed, msgpack maps over ZeroMQ multipart, never pickle.

One dataclass per message type is the single definition the stage, the coordinator's service and the
dispatcher all use. On the wire a message is one msgpack map with a "type" and the class's fields; a
message that carries a payload inline (a final stage's output) adds one more ZeroMQ frame holding a
codec frame. Stage replicas talk to the coordinator over one DEALER socket each; the coordinator binds
a ROUTER. Payloads between stages never travel here: only the connector metadata that locates them.

`unpack` checks every field's type (a bool is not an int, an enum's value one of its members) and rejects
unknown types, missing fields
and oversized messages (registers and heartbeats, kept while their replica lives, have a lower limit)
with `MalformedMessage`, naming the request (`rid`) whenever it can be read, so
the receiver fails that request at once; fields it does not know are ignored, so a newer peer can add
some. `pack` refuses to make a message the receiver would refuse (`MessageTooLarge`): the sender fails
the request with that error instead of sending it.
"""

from __future__ import annotations

import dataclasses
import enum
import types
import typing
from dataclasses import dataclass, field
from typing import Any, ClassVar, Union

import msgpack

#: A control message carries metadata only; anything larger is a bug or an attack. (A final output
#: rides in a separate frame, bounded by the socket's own limit.)
MAX_MESSAGE_BYTES = 1 << 20
#: The largest frame the coordinator's socket takes (a final output rides inline); libzmq drops the
#: connection of a peer that sends more, before buffering it. Stages check their outputs against it.
#: It bounds what one connection makes the coordinator hold: at 256 MiB, three 200 MiB frames from
#: a key holder took it to +740 MiB. 64 MiB is an answer of 85 MB of base64 JSON, past any REST client.
MAX_FRAME_BYTES = 64 * 1024 * 1024
#: A register or heartbeat: what it says the coordinator keeps for as long as the replica lives and
#: shows on /v1/stages (its connectors' health, their lifecycle tokens), so it is held far below
#: MAX_MESSAGE_BYTES. Real ones are under 1 KiB (a replica with two connectors: 0.6 KiB).
MAX_STATE_BYTES = 64 * 1024


class MessageTooLarge(ValueError):
    """A message that packs to more than its type's limit (`Message.MAX_BYTES`): its receiver would
    refuse it, so it is not sent. `rid` names its request, if it has one."""

    def __init__(self, message: Message, size: int) -> None:
        self.rid: str | None = getattr(message, "rid", None)
        about = f" for request {self.rid}" if self.rid else ""
        super().__init__(
            f"the {message.TYPE} message{about} is {size} bytes, over the control plane's limit of "
            f"{message.MAX_BYTES} bytes for it (control messages carry metadata only)"
        )
        self.size = size


class MalformedMessage(ValueError):
    """A control message that does not follow its type's definition. `rid` names the request it was
    about when that much could be read, so the receiver can fail that request instead of dropping it."""

    def __init__(self, reason: str, rid: str | None = None) -> None:
        super().__init__(reason)
        self.rid = rid


@dataclass(slots=True)
class Message:
    TYPE: ClassVar[str] = ""
    MAX_BYTES: ClassVar[int] = MAX_MESSAGE_BYTES  # the largest one of this type, packed

    def to_map(self) -> dict[str, Any]:
        return {"type": self.TYPE, **{name: getattr(self, name) for name in _FIELDS[self.TYPE]}}


# ---------------------------------------------------------------- stage -> coordinator


@dataclass(slots=True)
class Register(Message):
    TYPE: ClassVar[str] = "register"
    MAX_BYTES: ClassVar[int] = MAX_STATE_BYTES
    stage: str
    replica: str
    pid: int
    host: str
    max_inflight: int
    edges: dict
    start: int = 0  # process start time (clock ticks since boot): with the pid, safe against reuse
    machine: str = ""
    pidns: str = ""
    netns: str = ""
    # Per connector type its lifecycle token (opaque to the coordinator, handed back to the type to
    # reclaim what the replica held once its process is gone: omni_mesh.connectors.lifecycle).
    cleanup: dict = field(default_factory=dict)
    connectors: dict = field(default_factory=dict)


@dataclass(slots=True)
class Heartbeat(Message):
    TYPE: ClassVar[str] = "heartbeat"
    MAX_BYTES: ClassVar[int] = MAX_STATE_BYTES
    replica: str
    inflight: int
    processed: int = 0
    errors: int = 0
    malformed: int = 0
    draining: bool = False
    connectors: dict = field(default_factory=dict)
    #: the requests it still works on: one the coordinator ended counts as busy until it is gone from here
    working: list = field(default_factory=list)
    counters: dict = field(default_factory=dict)  # the handler's own numbers (handler_counters), name -> value


@dataclass(slots=True)
class Output(Message):
    """One output (or streamed chunk, or a stream's end) of a stage; `edges` maps each downstream
    stage to {key, meta}. A final stage's output rides in the next ZeroMQ frame."""

    TYPE: ClassVar[str] = "output"
    rid: str
    stage: str
    replica: str
    edges: dict
    seq: int
    last: bool
    end: bool = False
    final: bool = False
    timings: dict = field(default_factory=dict)


class FailureKind(str, enum.Enum):
    """Why a stage failed a request (`Error.kind`). The stage says what happened; what a client is
    answered for it is the coordinator's to say, in one place (coordinator/scheduling/failures.py)."""

    HANDLER_FAILED = "handler_failed"  # the handler raised
    INVALID_INPUT = "invalid_input"  # the handler refused the request's inputs or params (InvalidInput)
    DEADLINE = "deadline"  # the request's deadline passed in the stage
    UNREADABLE_WORK = "unreadable_work"  # the stage could not read the work it was sent
    CONNECTOR_FULL = "connector_full"  # a connector had no room (ConnectorFull): the request may pass later
    #: the data plane failed: a payload gone or cut short, a peer unreachable, a connector closed
    CONNECTOR_FAILED = "connector_failed"
    CONNECTOR_REFUSED = "connector_refused"  # a connector refused what the handler gave it (cannot carry it)
    #: an output lost with a dropped control connection, no longer kept to send again (stage/sent.py)
    OUTPUT_LOST = "output_lost"
    #: the replica has no free slot (its own `max_inflight`, the authority with several coordinators):
    #: no failure, the coordinator places the work again (coordinator/scheduling/dispatch.py)
    REPLICA_FULL = "replica_full"


@dataclass(slots=True)
class Error(Message):
    """A stage failed request `rid`: `kind` says how, `error` says what (naming edge and key where a
    connector failed)."""

    TYPE: ClassVar[str] = "error"
    rid: str
    stage: str
    replica: str
    error: str
    kind: FailureKind  # required: a stage always says why (an older peer's `status` is not guessed at)


@dataclass(slots=True)
class Deregister(Message):
    TYPE: ClassVar[str] = "deregister"
    replica: str


@dataclass(slots=True)
class Resync(Message):
    """The replica's control connection dropped and is back: messages in flight either way may be
    lost, so the coordinator is asked to reconcile (it answers `Reconcile`)."""

    TYPE: ClassVar[str] = "resync"
    replica: str


@dataclass(slots=True)
class Holding(Message):
    """The answer to `Reconcile`: every request the replica still works on, and for each streamed
    one the seq of the next chunk it lacks (the coordinator sends it again from there)."""

    TYPE: ClassVar[str] = "holding"
    replica: str
    rids: list
    chunks: dict = field(default_factory=dict)
    ask: int = 0  # the Reconcile's, echoed: an answer to an older question is not taken for a newer one's


# ---------------------------------------------------------------- coordinator -> stage


@dataclass(slots=True)
class Registered(Message):
    TYPE: ClassVar[str] = "registered"
    replica: str
    heartbeat_s: float  # how often the replica must heartbeat: the coordinator's clock is the one that counts


@dataclass(slots=True)
class Rejected(Message):
    TYPE: ClassVar[str] = "rejected"
    replica: str
    error: str
    reregister: bool = False  # true: register again (the coordinator restarted or took us out)


@dataclass(slots=True)
class Work(Message):
    """A request's work for one stage. An entry stage gets `inputs` (or `inputs_ref`, the connector
    metadata of inputs too large for a control message); others get `sources` {src: [{key, meta}]}
    and/or `stream_from` (chunks follow as `Chunk` messages)."""

    TYPE: ClassVar[str] = "work"
    rid: str
    stage: str
    params: dict
    remaining_s: float = 0.0
    inputs: Any = None
    inputs_ref: dict | None = None
    sources: dict | None = None
    streamed: list = field(default_factory=list)
    stream_from: str | None = None
    stream: bool = False  # the client reads the final output as a stream (handlers may stream to it)

    @property
    def is_entry(self) -> bool:
        return self.sources is None and self.stream_from is None


@dataclass(slots=True)
class Chunk(Message):
    """The next streamed chunk of an accepted request (`end`: the stream is over, no payload)."""

    TYPE: ClassVar[str] = "chunk"
    rid: str
    src: str
    key: str
    seq: int
    last: bool
    meta: Any = None
    end: bool = False


@dataclass(slots=True)
class Abort(Message):
    TYPE: ClassVar[str] = "abort"
    rid: str
    reason: str


@dataclass(slots=True)
class Reconcile(Message):
    """The requests the coordinator believes the replica holds. Sent on the same connection after any
    work before it, so the replica's answer (`Holding`) tells which of them were lost either way.
    `seqs`: per request, the seq of the next output the coordinator lacks from the replica, which
    sends again what it sent from there (stage.sent) before it answers."""

    TYPE: ClassVar[str] = "reconcile"
    replica: str
    rids: list
    ask: int = 0  # numbers the question (the answer echoes it)
    seqs: dict = field(default_factory=dict)


@dataclass(slots=True)
class Drained(Message):
    """Draining, and every request the replica took part in has ended: it may exit."""

    TYPE: ClassVar[str] = "drained"
    replica: str


MESSAGE_TYPES: dict[str, type[Message]] = {
    cls.TYPE: cls
    for cls in (
        Register, Heartbeat, Output, Error, Deregister, Resync, Holding,
        Registered, Rejected, Work, Chunk, Abort, Reconcile, Drained,
    )
}


#: What a field accepts: its types, an enum (the wire carries a member's value), or None for anything.
_Accepts = tuple[type, ...] | type[enum.Enum] | None


def _field_table(cls: type[Message]) -> tuple[tuple[str, _Accepts, bool], ...]:
    """(name, what it accepts, required) per field, from the class's annotations."""
    hints = typing.get_type_hints(cls)
    table: list[tuple[str, _Accepts, bool]] = []
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        accepted: _Accepts
        if isinstance(hint, type) and issubclass(hint, enum.Enum):
            accepted = hint
        elif hint is Any:
            accepted = None
        elif isinstance(hint, types.UnionType) or typing.get_origin(hint) is Union:
            accepted = tuple(typing.get_origin(a) or a for a in typing.get_args(hint))
        else:
            accepted = (typing.get_origin(hint) or hint,)
        if isinstance(accepted, tuple) and float in accepted:
            accepted = (*accepted, int)  # msgpack may send a whole number of seconds as an int
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        table.append((f.name, accepted, required))
    return tuple(table)


_TABLES = {kind: _field_table(cls) for kind, cls in MESSAGE_TYPES.items()}
_FIELDS = {kind: tuple(name for name, _, _ in table) for kind, table in _TABLES.items()}


def pack(message: Message) -> bytes:
    """The message on the wire; MessageTooLarge when it would be over its type's MAX_BYTES."""
    raw = msgpack.packb(message.to_map(), use_bin_type=True)
    if len(raw) > message.MAX_BYTES:
        raise MessageTooLarge(message, len(raw))
    return raw


#: How much of an oversized message is read for its rid, and the fields that may stand before it
#: (`Message.to_map` puts "type" first and "rid" right after it).
_PEEK_BYTES = 64 * 1024
_PEEK_FIELDS = 8


def _peek_rid(raw: bytes | memoryview) -> str | None:
    """The rid of a message too large to decode, read from its first few fields only; None if the
    message does not start like one of ours with a rid."""
    unpacker = msgpack.Unpacker(raw=False, max_buffer_size=_PEEK_BYTES, strict_map_key=False)
    try:
        unpacker.feed(raw[:_PEEK_BYTES])
        for _ in range(min(unpacker.read_map_header(), _PEEK_FIELDS)):
            key, value = unpacker.unpack(), unpacker.unpack()
            if key == "rid":
                return value if isinstance(value, str) else None
    except Exception:  # not a map, a field too large to be a small one, cut off: no rid to tell
        return None
    return None


def unpack(raw: bytes | memoryview) -> Message:
    """Decode and check one message; raises MalformedMessage with the reason (and the rid, if any)."""
    if len(raw) > MAX_MESSAGE_BYTES:
        raise MalformedMessage(f"control message of {len(raw)} bytes exceeds {MAX_MESSAGE_BYTES}", _peek_rid(raw))
    try:
        data = msgpack.unpackb(raw, raw=False, strict_map_key=False)
    except Exception as exc:
        raise MalformedMessage(f"undecodable control message: {exc}") from None
    if not isinstance(data, dict):
        raise MalformedMessage(f"control message is a {type(data).__name__}, not a map")
    kind = data.get("type")
    cls = MESSAGE_TYPES.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise MalformedMessage(f"unknown control message type {str(kind)[:40]!r}")
    rid = data.get("rid") if isinstance(data.get("rid"), str) else None
    if len(raw) > cls.MAX_BYTES:
        raise MalformedMessage(f"{kind} message of {len(raw)} bytes exceeds its limit of {cls.MAX_BYTES}", rid)
    values = {}
    for name, accepted, required in _TABLES[kind]:
        if name not in data:
            if required:
                raise MalformedMessage(f"{kind} message: field {name!r} missing", rid)
            continue
        value = data[name]
        if isinstance(accepted, type):  # an enum: a member's value, or the message is refused
            value = _member(accepted, value, f"{kind} message: field {name!r}", rid)
        elif accepted is not None and (
            not isinstance(value, accepted) or (isinstance(value, bool) and bool not in accepted)
        ):
            expected = " or ".join(t.__name__ for t in accepted)
            raise MalformedMessage(f"{kind} message: field {name!r} is not {expected}", rid)
        values[name] = value
    return cls(**values)


def _member(kinds: type[enum.Enum], value: Any, where: str, rid: str | None) -> enum.Enum:
    try:
        return kinds(value)
    except (ValueError, TypeError):
        known = ", ".join(str(member.value) for member in kinds)
        raise MalformedMessage(f"{where} is {repr(value)[:40]}, not one of {known}", rid) from None
