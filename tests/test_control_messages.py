"""Control messages are metadata only (control.MAX_MESSAGE_BYTES): a sender never sends a larger one,
and a receiver that gets one anyway can still tell which request it was about, so that request fails
at once instead of waiting for its deadline."""

from __future__ import annotations

import asyncio

import msgpack
import pytest

from omni_mesh import control
from omni_mesh.control import Error, Heartbeat, Output, Register, Work
from omni_mesh.stage.context import ChunkStream

BIG = 1_200_000


def test_pack_refuses_a_message_over_the_limit_naming_type_and_request() -> None:
    message = Output("rid-1", "thinker", "thinker-0", {"talker": {"key": "k", "meta": {"header": bytes(BIG)}}}, 0, True)
    with pytest.raises(control.MessageTooLarge, match=r"output message for request rid-1 is \d+ bytes") as caught:
        control.pack(message)
    assert caught.value.rid == "rid-1" and caught.value.size > control.MAX_MESSAGE_BYTES
    small = Work("rid-2", "talker", {}, inputs={"prompt": "x" * 1000})
    assert control.unpack(control.pack(small)) == small


@pytest.mark.parametrize(
    "message",
    [
        Output("rid-1", "thinker", "thinker-0", {"talker": {"key": "k", "meta": {"h": bytes(BIG)}}}, 0, True),
        Error("rid-1", "thinker", "thinker-0", "x" * BIG, control.FailureKind.HANDLER_FAILED),
    ],
    ids=["output", "error"],
)
def test_an_oversized_message_is_refused_with_its_request_id(message: control.Message) -> None:
    raw = msgpack.packb(message.to_map(), use_bin_type=True)
    with pytest.raises(control.MalformedMessage, match="exceeds") as caught:
        control.unpack(raw)
    assert caught.value.rid == "rid-1"


@pytest.mark.parametrize(
    "body",
    [
        {"type": "output", "rid": "x" * BIG},  # a rid too large to be one
        {"type": "output", "edges": {"d": bytes(BIG)}, "rid": "late"},  # the rid behind a large field
        ["output", "rid-1", bytes(BIG)],  # not a map
    ],
    ids=["huge rid", "rid after a large field", "not a map"],
)
def test_an_oversized_message_without_a_readable_rid_names_none(body: object) -> None:
    with pytest.raises(control.MalformedMessage) as caught:
        control.unpack(msgpack.packb(body, use_bin_type=True))
    assert caught.value.rid is None


def test_an_oversized_message_cut_short_names_none() -> None:
    raw = msgpack.packb({"type": "output", "rid": "rid-1", "edges": bytes(BIG)}, use_bin_type=True)
    assert control._peek_rid(raw[:3]) is None
    with pytest.raises(control.MalformedMessage) as caught:
        control.unpack(raw)
    assert caught.value.rid == "rid-1"


def test_registers_and_heartbeats_have_the_lower_limit_of_what_is_kept() -> None:
    """A register or heartbeat is kept while its replica lives: over MAX_STATE_BYTES neither is made,
    nor taken, though far under the limit of other messages."""
    pad = {"shm": {"status": "healthy", "pad": "x" * control.MAX_STATE_BYTES}}
    beat = Heartbeat("a-0", 0, connectors=pad)
    register = Register("a", "a-0", 1, "host", 1, {}, connectors=pad)
    for message in (beat, register):
        with pytest.raises(control.MessageTooLarge, match=f"limit of {control.MAX_STATE_BYTES} bytes"):
            control.pack(message)
        raw = msgpack.packb(message.to_map(), use_bin_type=True)
        assert len(raw) < control.MAX_MESSAGE_BYTES
        with pytest.raises(control.MalformedMessage, match=f"{message.TYPE} message of .* exceeds its limit"):
            control.unpack(raw)
    assert control.unpack(control.pack(Heartbeat("a-0", 0, connectors={"shm": {"status": "healthy"}}))).inflight == 0


class _Chatty:
    """A (third-party) connector whose health report is long: a log in it."""

    def health(self) -> dict:
        return {"status": "degraded", "log": "x" * control.MAX_STATE_BYTES}


def test_a_replica_sends_only_the_status_of_a_health_report_too_large_for_a_heartbeat() -> None:
    """Otherwise its heartbeats would be refused and the coordinator would take it for dead."""
    from omni_mesh.stage.link import ConnectorHealth

    health = ConnectorHealth({"chatty": _Chatty()}, "a-0", "test-health")  # type: ignore[dict-item]
    try:
        report = asyncio.run(health.read())
    finally:
        health.close()
    assert report["chatty"]["status"] == "degraded" and "only its status is sent" in report["chatty"]["error"]
    assert control.unpack(control.pack(Heartbeat("a-0", 0, connectors=report))).connectors == report


def test_the_reconcile_messages_travel_and_are_checked() -> None:
    """Resync, Reconcile and Holding round-trip; a Holding whose rids is not a list is refused, naming
    the field."""
    for message in (
        control.Resync("a-0"),
        control.Reconcile("a-0", ["r1", "r2"], ask=7),
        control.Holding("a-0", ["r1"], {"r1": 3}, ask=7),
    ):
        assert control.unpack(control.pack(message)) == message
    raw = msgpack.packb({"type": "holding", "replica": "a-0", "rids": "r1"})
    with pytest.raises(control.MalformedMessage, match="field 'rids' is not list"):
        control.unpack(raw)


def test_a_stream_takes_its_chunks_in_order_and_each_once() -> None:
    """After a dropped connection chunks come again (from the first the replica lacks) and a later one
    may come first: the handler still reads 0, 1, 2, then the end, once each."""

    async def fetch(chunk: control.Chunk) -> int:
        return chunk.seq

    async def read() -> list[int]:
        stream = ChunkStream(fetch)
        for seq in (0, 2, 0, 1, 2, 1):
            stream.feed(control.Chunk("r", "a", f"r/{seq}", seq, last=False))
        assert stream.expected == 3
        stream.feed(control.Chunk("r", "a", "", 3, last=True, end=True))
        return [seq async for seq in stream]

    assert asyncio.run(read()) == [0, 1, 2]


def test_a_failure_kind_travels_as_its_name_and_comes_back_as_the_kind() -> None:
    for kind in control.FailureKind:
        message = Error("rid-1", "talker", "talker-0", "why", kind)
        assert msgpack.unpackb(control.pack(message))["kind"] == kind.value
        assert control.unpack(control.pack(message)) == message


#: An error message on the wire, but for its kind.
ERROR_BODY = {"type": "error", "rid": "rid-1", "stage": "talker", "replica": "talker-0", "error": "why"}


@pytest.mark.parametrize(
    ("kind", "shown"),
    [("on_fire", "'on_fire'"), (503, "503"), (None, "None"), (["deadline"], "['deadline']")],
    ids=["unknown name", "an HTTP status", "null", "a list"],
)
def test_an_error_with_an_unknown_failure_kind_is_refused_naming_the_field_and_the_kinds(
    kind: object, shown: str
) -> None:
    body = {**ERROR_BODY, "kind": kind}
    with pytest.raises(control.MalformedMessage) as refused:
        control.unpack(msgpack.packb(body, use_bin_type=True))
    assert refused.value.rid == "rid-1"  # the receiver fails that request at once
    known = ", ".join(k.value for k in control.FailureKind)
    assert str(refused.value) == f"error message: field 'kind' is {shown}, not one of {known}"


def test_an_error_that_says_no_kind_is_refused() -> None:
    """An older stage's error (an HTTP `status`, no kind) is not guessed at."""
    body = {**ERROR_BODY, "status": 503}
    with pytest.raises(control.MalformedMessage, match="error message: field 'kind' missing") as refused:
        control.unpack(msgpack.packb(body, use_bin_type=True))
    assert refused.value.rid == "rid-1"
