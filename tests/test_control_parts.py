"""Several control messages in one multipart (omni_mesh.control_parts), a replica's sender that puts the
messages of one loop turn together (omni_mesh.stage.outgoing), and the small outputs a final stage frames
on its event loop (omni_mesh.stage.client_frame)."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import pytest

from omni_mesh import codec, control_parts
from omni_mesh.stage.client_frame import _small, client_frame
from omni_mesh.stage.outgoing import Outgoing


def test_one_message_keeps_the_form_it_always_had() -> None:
    assert control_parts.join([(b"m", None)]) == [b"m"]
    assert control_parts.join([(b"m", b"frame")]) == [b"m", b"frame"]
    assert control_parts.split([b"m"]) == [(b"m", None)]
    assert control_parts.split([b"m", b"frame"]) == [(b"m", b"frame")]


def test_several_small_messages_go_in_one_part() -> None:
    messages = [(b"\x81a", None), (b"\x81b", b"frame b"), (b"\x81c", None)]
    parts = control_parts.join(messages)
    assert len(parts) == 1 and parts[0][:1] == control_parts.BUNDLE  # one send: one hand-over of the GIL
    pairs = control_parts.split(parts)
    assert [(bytes(m), None if f is None else bytes(f)) for m, f in pairs] == messages
    assert control_parts.split([b"\x81a"]) == [(b"\x81a", None)]  # a lone message (a map) is no bundle
    with pytest.raises(ValueError, match="cut short"):  # a bundle cut short is refused
        control_parts.split([parts[0][:-3]])


def test_several_messages_with_a_large_frame_pair_with_their_frames() -> None:
    large = b"x" * (control_parts.BUNDLE_BYTES + 1)  # not copied into a bundle
    messages = [(b"a", None), (b"b", large), (b"c", None)]
    parts = control_parts.join(messages)
    assert parts == [b"a", b"", b"b", large, b"c", b""]
    assert control_parts.split(parts) == messages
    with pytest.raises(ValueError, match="3 parts"):
        control_parts.split([b"a", b"", b"b"])


class _Socket:
    def __init__(self) -> None:
        self.sent: list[list] = []

    async def send_multipart(self, parts: list, copy: bool = True) -> None:
        self.sent.append(parts)


def test_messages_of_one_loop_turn_go_together_in_order() -> None:
    async def main() -> list[list]:
        socket = _Socket()
        out = Outgoing(socket, "test")
        await asyncio.gather(*(out.send(f"m{i}".encode(), b"f" if i == 1 else None) for i in range(3)))
        await asyncio.sleep(0)
        await out.send(b"later")
        await asyncio.sleep(0)
        assert (out.sends, out.messages) == (2, 4)
        return socket.sent

    sent = asyncio.run(main())
    assert [[bytes(m) for m, _ in control_parts.split(parts)] for parts in sent] == [
        [b"m0", b"m1", b"m2"],
        [b"later"],
    ]
    assert bytes(control_parts.split(sent[0])[1][1]) == b"f" and sent[1] == [b"later"]


def test_small_plain_outputs_are_framed_on_the_loop_alike() -> None:
    chunk = {"text": "hello", "usage": {"prompt_tokens": 3, "completion_tokens": 2}, "finish_reason": None}
    assert _small(chunk)
    assert not _small({"text": "x" * 20_000})
    assert not _small({"codes": [1, 2, 3]})
    assert not _small(["text"])

    async def main() -> bytes | bytearray:
        with ThreadPoolExecutor(1) as pool:
            return await client_frame("thinker", chunk, pool)

    frame = asyncio.run(main())
    assert bytes(frame) == bytes(codec.encode(chunk))
    assert codec.decode(frame) == chunk
