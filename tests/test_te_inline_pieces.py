"""The Mooncake TE connector's small pieces ride the producer's answer (mooncake/frame_pieces.py):
what the producer splits off, the consumer puts back byte for byte; an answer whose pieces lie outside
the frame, exceed the cap or are malformed is refused before a byte is copied."""

from __future__ import annotations

import ctypes

import msgpack
import pytest

from omni_mesh.connectors.mooncake.frame_pieces import INLINE_BYTES, place_inline, split_inline


def address(buffer: ctypes.Array) -> int:
    return ctypes.addressof(buffer)


def test_small_pieces_ride_the_answer_and_land_where_the_engine_would_have_written_them() -> None:
    frame = (bytes(range(256)) * 1024)[:205_096]  # laid out as head, small leaf, large leaf, small leaf
    source = ctypes.create_string_buffer(frame, len(frame))
    pieces = [
        (address(source), 0, 512),
        (address(source) + 512, 512, 3584),
        (address(source) + 4096, 4096, 200_000),
        (address(source) + 204_096, 204_096, len(frame) - 204_096),
    ]
    written, inline = split_inline(pieces)
    assert written == [pieces[2]]  # the large leaf only: the engine's one write
    target = ctypes.create_string_buffer(len(frame))
    for source_address, at, size in written:
        ctypes.memmove(address(target) + at, source_address, size)
    assert inline is not None
    place_inline(inline, address(target), len(frame))
    assert target.raw == frame


def test_pieces_past_the_cap_go_through_the_engine() -> None:
    source = ctypes.create_string_buffer(3 * INLINE_BYTES)
    pieces = [(address(source) + i * INLINE_BYTES, i * INLINE_BYTES, INLINE_BYTES - 8) for i in range(3)]
    written, inline = split_inline(pieces)
    assert len(written) == 2 and len(msgpack.unpackb(inline)) == 1


@pytest.mark.parametrize(
    ("pieces", "said"),
    [
        ([[90, b"x" * 20]], "outside the 100-byte frame"),
        ([[-1, b"x"]], "outside"),
        ([[0, "text"]], "malformed inline piece"),
        ([[0]], "malformed inline piece"),
        ({"0": b"x"}, "malformed inline pieces"),
        ([[0, b"x" * 60]] * 1200, "malformed inline pieces"),  # more than twice the cap on the wire
    ],
)
def test_an_answer_with_bad_pieces_is_refused_before_anything_is_copied(pieces: object, said: str) -> None:
    target = ctypes.create_string_buffer(b"\x00" * 100, 100)
    with pytest.raises(ValueError, match=said):
        place_inline(msgpack.packb(pieces), address(target), 100)
    assert target.raw == b"\x00" * 100


def test_more_inline_bytes_than_the_cap_are_refused() -> None:
    length = 4 * INLINE_BYTES
    target = ctypes.create_string_buffer(length)
    pieces = [[i * 1024, b"y" * 1024] for i in range(INLINE_BYTES // 1024 + 1)]
    with pytest.raises(ValueError, match="more inline bytes"):
        place_inline(msgpack.packb(pieces), address(target), length)
    assert target.raw == b"\x00" * length
