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


def test_several_messages_pair_with_their_frames() -> None:
    messages = [(b"a", None), (b"b", b"frame b"), (b"c", None)]
    parts = control_parts.join(messages)
    assert parts == [b"a", b"", b"b", b"frame b", b"c", b""]
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
    assert sent == [[b"m0", b"", b"m1", b"f", b"m2", b""], [b"later"]]


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
