"""A minimal HTTP/1.1 keep-alive client for benchmark load loops.

A general client (httpx) spends about 5 ms of CPU per request here, more than the mesh it
measures, so on a 2-core machine it would benchmark itself. This one only POSTs JSON and reads a
Content-Length response, which is all the coordinator sends for non-streaming requests.
"""

from __future__ import annotations

import asyncio

import httpx


class Connection:
    def __init__(self, url: str) -> None:
        target = httpx.URL(url)
        self.host, self.port = target.host, target.port or 80
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def post(self, path: str, body: bytes) -> tuple[int, dict[str, str], bytes]:
        """(status, headers with lower-case names, body); opens the connection when needed."""
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
        if "content-length" not in headers:
            raise ConnectionError("response without Content-Length")
        return status, headers, await self.reader.readexactly(int(headers["content-length"]))

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        self.reader = self.writer = None
