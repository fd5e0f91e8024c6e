"""A minimal HTTP/1.1 keep-alive client for benchmark load loops.

A general client (httpx) spends about 5 ms of CPU per request here, more than the mesh it
measures, so on a 2-core machine it would benchmark itself. This one only POSTs JSON and reads a
Content-Length response, which is all the coordinator sends for non-streaming requests, or reads a
server-sent event stream's data lines (`bench thinker`: two servers' streams, the client's cost kept small).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import httpx


class Connection:
    def __init__(self, url: str) -> None:
        target = httpx.URL(url)
        self.host, self.port = target.host, target.port or 80
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def post(self, path: str, body: bytes) -> tuple[int, dict[str, str], bytes]:
        """(status, headers with lower-case names, body); opens the connection when needed."""
        status, headers = await self._send(path, body)
        assert self.reader is not None
        if "content-length" not in headers:
            raise ConnectionError("response without Content-Length")
        return status, headers, await self.reader.readexactly(int(headers["content-length"]))

    async def _send(self, path: str, body: bytes) -> tuple[int, dict[str, str]]:
        """POST `body`; (status, headers with lower-case names), the body left to read."""
        if self.writer is None or self.writer.is_closing():
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        assert self.reader is not None
        head = (
            f"POST {path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        )
        self.writer.write(head.encode() + body)
        status_line = await self.reader.readline()
        if not status_line:
            raise ConnectionError("the coordinator closed the connection")
        status = int(status_line.split()[1])
        headers = {}
        while (line := await self.reader.readline()) not in (b"\r\n", b""):
            name, _, value = line.decode("latin-1").partition(":")
            headers[name.strip().lower()] = value.strip()
        return status, headers

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        self.reader = self.writer = None

    async def events(self, path: str, body: bytes, on_data: Callable[[bytes], None]) -> tuple[int, bytes]:
        """POST `body` and read a server-sent event stream: `on_data(payload)` for each `data:` line as it
        arrives (chunked transfer encoding, as both uvicorn and the coordinator send it). (status, the body
        of a response that is no stream: an error's)."""
        status, headers = await self._send(path, body)
        assert self.reader is not None
        if "content-length" in headers:
            return status, await self.reader.readexactly(int(headers["content-length"]))
        if headers.get("transfer-encoding", "").lower() != "chunked":
            raise ConnectionError(f"{path}: a stream neither chunked nor with a Content-Length ({headers})")
        pending = b""
        while size := int((await self.reader.readline()).split(b";")[0], 16):
            pending += (await self.reader.readexactly(size + 2))[:-2]
            *lines, pending = pending.split(b"\n")
            for line in lines:
                if line.startswith(b"data: "):
                    on_data(line[6:])
        await self.reader.readline()  # the empty trailer's CRLF
        return status, b""
