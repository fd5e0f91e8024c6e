"""What a stage handler is given: `ctx` (`StageContext`), a streamed input (`ChunkStream`), and the
error a missing input raises (`StageInputError`)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from omni_mesh.control import Chunk, FailureKind


@dataclass
class StageContext:
    """What a handler knows about the request it is working on: the runtime's `HandlerContext`
    (omni_mesh.handlers)."""

    request_id: str
    params: dict
    stage: str
    replica: str
    deadline: float  # event-loop time
    stream: bool = False  # the client reads the final output as a stream
    #: Allocates output tensors where the outgoing edge keeps memory (`empty`); None: ordinary tensors.
    allocate: Callable[[tuple[int, ...], Any], Any] | None = field(default=None, repr=False)

    def remaining(self) -> float:
        return max(0.0, self.deadline - asyncio.get_running_loop().time())

    def empty(self, shape: tuple[int, ...] | list[int], dtype: Any) -> Any:
        """An uninitialized output tensor already in the memory of this stage's FIRST outgoing edge (in
        topology order): returned in the output, its put there copies nothing; other edges get a copy,
        as for any tensor. Do not write into it after returning it. Synchronous (the pool may grow):
        call it where the output is computed, e.g. in the handler's worker thread."""
        if self.allocate is None:
            import torch  # handlers that never ask for an output tensor do not need it here

            return torch.empty(tuple(shape), dtype=dtype)
        return self.allocate(tuple(shape), dtype)


class StageInputError(RuntimeError):
    """An input payload could not be fetched (gone, stale, or the connector failed; the message names the
    edge). `kind`: the data plane failed, not the handler (CONNECTOR_FAILED), or a connector had no room
    (CONNECTOR_FULL: the same request may pass later)."""

    def __init__(self, message: str, kind: FailureKind = FailureKind.CONNECTOR_FAILED) -> None:
        super().__init__(message)
        self.kind = kind


_END = object()


class ChunkStream:
    """The async iterator a handler reads a streamed input from; fetches each chunk as it is read."""

    def __init__(self, fetch: Callable[[Chunk], Any]) -> None:
        self._fetch = fetch
        self._queue: asyncio.Queue[Any] = asyncio.Queue()
        # Chunks go to the handler in seq order, each once: after a dropped control connection the
        # coordinator sends again from `expected`, and a chunk sent after the drop may come first.
        self.expected = 0
        self._early: dict[int, Chunk] = {}

    def feed(self, chunk_message: Chunk) -> None:
        seq = chunk_message.seq
        if seq < self.expected or seq in self._early:
            return  # a chunk sent again that we already have
        self._early[seq] = chunk_message
        while self.expected in self._early:
            chunk = self._early.pop(self.expected)
            self.expected += 1
            self._queue.put_nowait(_END if chunk.end else chunk)

    def fail(self, error: BaseException) -> None:
        self._queue.put_nowait(error)

    def __aiter__(self) -> AsyncIterator[Any]:
        return self

    async def __anext__(self) -> Any:
        item = await self._queue.get()
        if item is _END:
            raise StopAsyncIteration
        if isinstance(item, BaseException):
            raise item
        return await self._fetch(item)
