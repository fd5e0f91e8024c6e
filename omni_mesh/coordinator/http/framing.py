"""Where each HTTP/1.1 request on a connection begins and ends, read from its bytes as they arrive.

The front door (front_door.py) needs only this much of a request: when its head starts and ends (for
the header deadline and the head limits), the URL's length, and when its body ends (Content-Length or
chunked; for the body deadline). It parses nothing else: uvicorn's own parser, fed the same bytes,
does. A head this reading cannot frame (a malformed length) is left to uvicorn's parser, which refuses
it with 400 and closes the connection: `Framing` then stops framing ("opaque").
"""

from __future__ import annotations

from dataclasses import dataclass

MAX_CHUNK_LINE = 1024  # a chunk's size line with its extensions; a longer one is not one we frame


class HeadTooLarge(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass
class Step:
    """What `Framing.feed` made of some bytes: how many belong to the current phase, and what ended."""

    used: int
    head_done: bool = False
    request_done: bool = False


class Framing:
    """One connection's requests, in phases: "idle" (between requests), "head", "body", "opaque"."""

    def __init__(self, max_head_bytes: int, max_url_bytes: int) -> None:
        self.max_head_bytes = max_head_bytes
        self.max_url_bytes = max_url_bytes
        self.phase = "idle"
        self._head = bytearray()  # the head so far (at most max_head_bytes)
        self._left = 0  # body bytes still to come (Content-Length), or of the current chunk (with its CRLF)
        self._chunked = False
        self._line = bytearray()  # a chunk-size or trailer line so far
        self._in_trailer = False

    def feed(self, data: bytes) -> Step:
        """Read the start of `data` within the current phase. HeadTooLarge before any byte of a head over
        a limit is counted: its caller refuses the request without passing those bytes on."""
        if self.phase == "opaque":
            return Step(len(data))
        if self.phase == "idle":
            self.phase = "head"
        if self.phase == "head":
            return self._feed_head(data)
        return self._feed_body(data)

    def _feed_head(self, data: bytes) -> Step:
        start = max(0, len(self._head) - 3)  # the blank line may straddle two reads
        seen = len(self._head)
        self._head += data[: self.max_head_bytes + 1 - seen]
        end = self._head.find(b"\r\n\r\n", start)
        head = self._head if end < 0 else self._head[: end + 4]
        self._check_url(head)
        if end < 0 or end + 4 > self.max_head_bytes:
            if len(head) > self.max_head_bytes:
                raise HeadTooLarge(431, f"the request's headers exceed {self.max_head_bytes} bytes")
            return Step(len(data))
        used = end + 4 - seen
        self._frame_body(bytes(head))
        self._head = bytearray()
        if self.phase == "body" and self._left == 0 and not self._chunked:
            self.phase = "idle"
        return Step(used, head_done=True, request_done=self.phase == "idle")

    def _check_url(self, head: bytes | bytearray) -> None:
        line = head.split(b"\r\n", 1)[0]
        parts = line.split(b" ", 2)
        if len(parts) > 1 and len(parts[1]) > self.max_url_bytes:
            raise HeadTooLarge(414, f"the request's URL exceeds {self.max_url_bytes} bytes")

    def _frame_body(self, head: bytes) -> None:
        lengths, chunked = set(), False
        for line in head.split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            name = name.strip().lower()
            if name == b"transfer-encoding":
                chunked = value.strip().lower().endswith(b"chunked")
            elif name == b"content-length":
                lengths.add(value.strip())
        if chunked:  # the transfer coding wins over a length (RFC 9112 6.3)
            self.phase, self._chunked, self._left, self._in_trailer = "body", True, 0, False
        elif not lengths:
            self.phase, self._chunked, self._left = "body", False, 0
        elif len(lengths) == 1 and next(iter(lengths)).isdigit():
            self.phase, self._chunked, self._left = "body", False, int(next(iter(lengths)))
        else:
            self.phase = "opaque"  # uvicorn's parser refuses it

    def _feed_body(self, data: bytes) -> Step:
        if not self._chunked:
            used = min(self._left, len(data))
            self._left -= used
            if self._left == 0:
                self.phase = "idle"
            return Step(used, request_done=self.phase == "idle")
        used = 0
        while used < len(data) and self.phase == "body":
            if self._left:  # chunk data and its CRLF
                take = min(self._left, len(data) - used)
                self._left -= take
                used += take
                continue
            newline = data.find(b"\n", used)
            piece = data[used:] if newline < 0 else data[used : newline + 1]
            self._line += piece
            used += len(piece)
            if len(self._line) > MAX_CHUNK_LINE:
                self.phase = "opaque"
            elif newline >= 0:
                self._end_line(bytes(self._line).strip())
                self._line = bytearray()
        return Step(used, request_done=self.phase == "idle")

    def _end_line(self, line: bytes) -> None:
        if self._in_trailer:
            if not line:  # the blank line after the last chunk's trailers
                self.phase = "idle"
            return
        size = line.split(b";", 1)[0].strip()
        try:
            self._left = int(size, 16)
        except ValueError:
            self.phase = "opaque"
            return
        if self._left == 0:
            self._in_trailer = True
        else:
            self._left += 2  # the CRLF after the chunk's data
