"""Control messages are metadata only (control.MAX_MESSAGE_BYTES): a sender never sends a larger one,
and a receiver that gets one anyway can still tell which request it was about, so that request fails
at once instead of waiting for its deadline."""

from __future__ import annotations

import msgpack
import pytest

from omni_mesh import control
from omni_mesh.control import Error, Output, Work

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
        Error("rid-1", "thinker", "thinker-0", "x" * BIG),
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
