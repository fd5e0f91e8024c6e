"""Running a blocking generate() in a stage's model thread while the handler streams what it makes:
items pass to the event loop as they come, and a cancelled request stops the generation."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Executor
from typing import Any

_DONE = object()


class Outbox:
    """Items handed from a model thread to one event loop's queues with one wake-up for all the items put
    before the loop gets to them: a running batch puts a token for each of its rows every step, and a
    wake-up each (a write to the loop's self-pipe, a loop iteration) cost the stage more than the tokens.
    Order per queue is kept; whatever the thread does after a put (completing a future) reaches the loop
    after it."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.lock = threading.Lock()
        self.pending: list[tuple[asyncio.Queue, Any]] = []
        self.scheduled = False

    def put(self, queue: asyncio.Queue, item: Any) -> None:
        with self.lock:
            self.pending.append((queue, item))
            if self.scheduled:
                return
            self.scheduled = True
        self.loop.call_soon_threadsafe(self._deliver)

    def _deliver(self) -> None:
        with self.lock:
            items, self.pending, self.scheduled = self.pending, [], False
        for queue, item in items:
            queue.put_nowait(item)


_OUTBOXES: dict[asyncio.AbstractEventLoop, Outbox] = {}


def outbox(loop: asyncio.AbstractEventLoop) -> Outbox:
    """The loop's Outbox (one per loop: a stage runs one)."""
    found = _OUTBOXES.get(loop)
    if found is None:
        for closed in [other for other in _OUTBOXES if other.is_closed()]:
            del _OUTBOXES[closed]
        found = _OUTBOXES[loop] = Outbox(loop)
    return found


class Generation:
    """`run(push, should_stop)` in `executor`; iterate to get what it pushes, then `await result()`.

    Leaving the iteration early (the request was cancelled or failed) sets the stop flag, which the
    generate() call checks after every step."""

    def __init__(
        self, executor: Executor | None, run: Callable[[Callable[[Any], None], Callable[[], bool]], Any],
        on_stop: Callable[[], None] | None = None,
    ) -> None:
        """`executor` None: `run(push, should_stop)` only hands the work on (to a running batch:
        omni_mesh.engines.batching, or an engine core) and returns the Future of its result. `on_stop`:
        called once, on the loop, when the generation is told to stop (an engine core polls no flag here)."""
        self.stop = threading.Event()
        self.on_stop = on_stop
        loop = asyncio.get_running_loop()
        self.items: asyncio.Queue[Any] = asyncio.Queue()
        box, items = outbox(loop), self.items

        def push(item: Any) -> None:
            box.put(items, item)

        if executor is None:
            self.future = asyncio.wrap_future(run(push, self.stop.is_set))
        else:
            self.future = loop.run_in_executor(executor, run, push, self.stop.is_set)
        self.future.add_done_callback(lambda _: self.items.put_nowait(_DONE))

    async def __aiter__(self) -> AsyncIterator[Any]:
        try:
            async for batch in self._drain(whole=False):
                yield batch[0]
        finally:
            self._leave()

    async def batches(self) -> AsyncIterator[list[Any]]:
        """As iterating, but every item already there at once: a stage that fell behind its model thread
        sends one chunk for several tokens instead of one each."""
        try:
            async for batch in self._drain(whole=True):
                yield batch
        finally:
            self._leave()

    def _leave(self) -> None:
        """The iteration ended (or was left early): a generation still running is told to stop."""
        if not self.future.done():
            self._stop()

    def _stop(self) -> None:
        if not self.stop.is_set():
            self.stop.set()
            if self.on_stop is not None:
                self.on_stop()

    async def _drain(self, *, whole: bool) -> AsyncIterator[list[Any]]:
        """The items as they come, one at a time or (`whole`) all there are; leaving early sets the stop flag."""
        try:
            while (item := await self.items.get()) is not _DONE:
                batch = [item]
                while whole and not self.items.empty():
                    item = self.items.get_nowait()
                    if item is _DONE:
                        self.items.put_nowait(_DONE)  # seen on the next call
                        break
                    batch.append(item)
                yield batch
                if self.stop.is_set():
                    return
        finally:
            self._leave()

    async def result(self) -> Any:
        return await self.future

    def cancel(self) -> None:
        self._stop()

    async def settle(self) -> None:
        """Stop the generation and wait until the model thread has really let go of it (the prefill
        stops within a piece, a generate() step within a step), even when this task is cancelled
        meanwhile: until then the replica counts the request in flight, so no new work is promised the
        model while it still computes. Its outcome is not read (the request ended)."""
        self._stop()
        cancelled = False
        while not self.future.done():
            try:
                await asyncio.wait([self.future])
            except asyncio.CancelledError:
                cancelled = True  # cancelled again (an abort after a deadline): still wait, then say so
        if not self.future.cancelled():
            self.future.exception()  # retrieved: a cancelled request's PrefillStopped is no error
        if cancelled:
            raise asyncio.CancelledError


def every(push: Any, interval: int) -> Any:
    """A running batch's push of one token, handing `push` lists of them: the first token at once, then
    every `interval` (engine.stream_interval); the tokens held at the end come with the output."""
    held: list[int] = []
    first = [True]

    def put(token: int) -> None:
        held.append(token)
        if first[0] or len(held) >= interval:
            push(held[:])
            held.clear()
            first[0] = False

    return put


def ignore(item: Any) -> None:
    """A push that hands nothing on (the client reads no stream)."""
