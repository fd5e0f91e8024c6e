"""The front door's reading of request framing (coordinator/http/framing.py), which the read deadlines
and head limits hang on: where a head ends, where a Content-Length or chunked body ends, pipelined
requests, and the heads it refuses before passing a byte of them on. Then the same over a real uvicorn
socket: a chunked body served and its connection kept, pipelined requests all answered, a trickled
chunked body cut at its deadline."""

from __future__ import annotations

import socket
import time

import pytest
from test_rest_front_door import _port, read_until_closed, serving, small_app

from omni_mesh.coordinator.http.framing import Framing, HeadTooLarge

HEAD = b"POST /raw HTTP/1.1\r\nHost: x\r\n"


def feed_all(framing: Framing, data: bytes, piece: int) -> list[tuple[int, bool, bool]]:
    """Feed `data` `piece` bytes at a time; every step as (used, head_done, request_done)."""
    steps = []
    for start in range(0, len(data), piece):
        rest = data[start : start + piece]
        while rest:
            step = framing.feed(rest)
            steps.append((step.used, step.head_done, step.request_done))
            rest = rest[step.used :]
    return steps


@pytest.mark.parametrize("piece", [1, 3, 7, 1000])
def test_a_chunked_body_ends_after_its_trailers_however_it_is_split(piece: int) -> None:
    body = b"5\r\nhello\r\n3;ext=1\r\nabc\r\n0\r\nX-Trailer: t\r\n\r\n"
    request = HEAD + b"Transfer-Encoding: chunked\r\n\r\n" + body
    framing = Framing(64 * 1024, 8 * 1024)
    steps = feed_all(framing, request, piece)
    assert sum(used for used, _, _ in steps) == len(request)
    assert [done for _, _, done in steps].count(True) == 1 and steps[-1][2], steps
    assert [head for _, head, _ in steps].count(True) == 1
    assert framing.phase == "idle"


@pytest.mark.parametrize("piece", [1, 5, 1000])
def test_pipelined_requests_are_told_apart(piece: int) -> None:
    one = HEAD + b"Content-Length: 4\r\n\r\nabcd"
    two = b"GET /ping HTTP/1.1\r\nHost: x\r\n\r\n"
    three = HEAD + b"Transfer-Encoding: chunked\r\n\r\n1\r\nz\r\n0\r\n\r\n"
    framing = Framing(64 * 1024, 8 * 1024)
    steps = feed_all(framing, one + two + three, piece)
    assert [done for _, _, done in steps].count(True) == 3 and framing.phase == "idle"


def test_a_body_still_arriving_keeps_the_request_open() -> None:
    framing = Framing(64 * 1024, 8 * 1024)
    data = HEAD + b"Content-Length: 100\r\n\r\n" + b"x" * 99
    head = framing.feed(data)
    assert head.head_done and not head.request_done and framing.phase == "body"
    body = framing.feed(data[head.used :])
    assert body.used == 99 and not body.request_done and framing.phase == "body"
    assert framing.feed(b"x").request_done


@pytest.mark.parametrize(
    ("data", "status"),
    [
        (b"GET /" + b"a" * 9000, 414),  # the URL is over the limit before its line ends
        (b"GET /" + b"a" * 9000 + b" HTTP/1.1\r\n\r\n", 414),
        (b"GET / HTTP/1.1\r\nX: " + b"y" * 70_000, 431),
        (b"GET / HTTP/1.1\r\nX: " + b"y" * (64 * 1024 - 22) + b"\r\n\r\n", 431),  # one byte over, complete
    ],
)
def test_heads_over_a_limit_are_refused(data: bytes, status: int) -> None:
    with pytest.raises(HeadTooLarge) as refused:
        feed_all(Framing(64 * 1024, 8 * 1024), data, 4096)
    assert refused.value.status == status


def test_a_head_at_the_limit_passes_and_a_bad_length_is_left_to_the_parser() -> None:
    head = b"GET / HTTP/1.1\r\nX: " + b"y" * (64 * 1024 - 23) + b"\r\n\r\n"
    assert len(head) == 64 * 1024
    assert Framing(64 * 1024, 8 * 1024).feed(head).request_done
    framing = Framing(64 * 1024, 8 * 1024)
    framing.feed(HEAD + b"Content-Length: ten\r\n\r\n")
    assert framing.phase == "opaque"  # uvicorn's parser answers 400 and closes


# ------------------------------------------------------------------ over a real socket


def test_a_chunked_body_is_served_and_its_connection_kept() -> None:
    request = HEAD + b"Transfer-Encoding: chunked\r\n\r\n" + b"5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n"
    with serving(small_app()) as url, socket.create_connection(("127.0.0.1", _port(url))) as sock:
        sock.sendall(request + request + b"GET /ping HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        data, _ = read_until_closed(sock, 10)
    assert data.count(b"HTTP/1.1 200 ") == 3 and data.count(b'{"bytes":11}') == 2, data


def test_a_trickled_chunked_body_is_cut_at_its_deadline() -> None:
    with serving(small_app(), body_timeout_s=0.5) as url, socket.create_connection(("127.0.0.1", _port(url))) as sock:
        sock.sendall(HEAD + b"Transfer-Encoding: chunked\r\n\r\n")
        start = time.monotonic()
        for _ in range(3):
            sock.sendall(b"1\r\nx\r\n")  # a chunk every 0.2 s, never the last one
            time.sleep(0.2)
        data, closed = read_until_closed(sock, 10)
    assert data.startswith(b"HTTP/1.1 408 ") and b"the request body did not arrive" in data, data
    assert closed - start < 3.0
