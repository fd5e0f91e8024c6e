"""Running a blocking generate() in a stage's model thread while the handler streams what it makes:
items pass to the event loop as they come, and a cancelled request stops the generation."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Executor
from typing import Any

_DONE = object()


class Generation:
    """`run(push, should_stop)` in `executor`; iterate to get what it pushes, then `await result()`.

    Leaving the iteration early (the request was cancelled or failed) sets the stop flag, which the
    generate() call checks after every step."""

    def __init__(
        self, executor: Executor | None, run: Callable[[Callable[[Any], None], Callable[[], bool]], Any],
    ) -> None:
        """`executor` None: `run(push, should_stop)` only hands the work on (to a running batch:
        omni_mesh.engines.batching) and returns the concurrent Future of its result."""
        self.stop = threading.Event()
        loop = asyncio.get_running_loop()
        self.items: asyncio.Queue[Any] = asyncio.Queue()

        def push(item: Any) -> None:
            loop.call_soon_threadsafe(self.items.put_nowait, item)

        if executor is None:
            self.future = asyncio.wrap_future(run(push, self.stop.is_set))
        else:
            self.future = loop.run_in_executor(executor, run, push, self.stop.is_set)
        self.future.add_done_callback(lambda _: self.items.put_nowait(_DONE))

    async def __aiter__(self) -> AsyncIterator[Any]:
        try:
            while (item := await self.items.get()) is not _DONE:
                yield item
                if self.stop.is_set():
                    return
        finally:
            if not self.future.done():
                self.stop.set()

    async def result(self) -> Any:
        return await self.future

    def cancel(self) -> None:
        self.stop.set()

    async def settle(self) -> None:
        """Stop the generation and wait until the model thread has really let go of it (the prefill
        stops within a piece, a generate() step within a step), even when this task is cancelled
        meanwhile: until then the replica counts the request in flight, so no new work is promised the
        model while it still computes. Its outcome is not read (the request ended)."""
        self.stop.set()
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
