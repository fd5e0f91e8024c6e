"""Whole calls of several requests made as one (code2wav's decode): what arrives while the model thread
is busy waits, and the next turn of the thread takes up to `max_batch` of it in one call.

No window to wait for company: a lone request goes at once, and under load the queue that forms
while one call runs is the next batch (the thinkers' continuous batching has steps to join between;
a whole decode has none). A request cancelled while it waits never runs.

Items submitted `first` (a stream's first chunk: what a new request's first audio waits for) go before
the others: a turn that finds any takes only those, in a call of their own (short, and not padded to the
others' longer windows), so a new request waits for at most the call that is running, not behind a
queue of the other streams' chunks.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Executor, Future
from typing import Any

COUNTERS = ("batch_queued", "batch_steps_total", "batch_rows_stepped_total")  # summed over a stage's gathers


class Gather:
    """`submit(item)` from any thread: a Future of `many([..., item, ...])`'s answer for it, computed in
    `executor` (the stage's model thread) together with the items queued beside it."""

    def __init__(self, executor: Executor, many: Callable[[list[Any]], list[Any]], max_batch: int) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        self.executor = executor
        self.many = many
        self.max_batch = max_batch
        self.pending: list[tuple[Any, Future, bool]] = []  # (item, its future, submitted first)
        self.lock = threading.Lock()
        self.calls_total = 0
        self.items_total = 0

    def submit(self, item: Any, *, first: bool = False) -> Future:
        """`first`: served before the items that are not, in a call of their own (module docstring)."""
        future: Future = Future()
        with self.lock:
            self.pending.append((item, future, first))
        self.executor.submit(self._drain)  # one turn per item: a turn that finds the queue empty returns
        return future

    def counters(self) -> dict[str, int]:
        """As a batch's (omni_mesh.engines.batching): calls made, items in them (/ calls: the mean batch)."""
        with self.lock:
            queued = len(self.pending)
        return {"batch_queued": queued, "batch_max": self.max_batch, "batch_steps_total": self.calls_total,
                "batch_rows_stepped_total": self.items_total}

    def _drain(self) -> None:
        taken: list[tuple[Any, Future]] = []
        with self.lock:
            firsts = any(first for *_, first in self.pending)
            left: list[tuple[Any, Future, bool]] = []
            for entry in self.pending:
                item, future, first = entry
                if len(taken) == self.max_batch or (firsts and not first):
                    left.append(entry)
                elif future.set_running_or_notify_cancel():  # False: cancelled while it waited
                    taken.append((item, future))
            self.pending = left
        if not taken:
            return
        try:
            answers = self.many([item for item, _ in taken])
        except BaseException as exc:  # noqa: BLE001 - the call failed: every item in it did
            for _, future in taken:
                future.set_exception(exc)
            return
        self.calls_total += 1
        self.items_total += len(taken)
        for (_, future), answer in zip(taken, answers, strict=True):
            future.set_result(answer)


def counters_of(gathers: list[Gather]) -> dict[str, int]:
    """A stage's gathers' counters (code2wav: whole decodes and streamed chunks) as one batch's."""
    out = {name: sum(gather.counters()[name] for gather in gathers) for name in COUNTERS}
    return {**out, "batch_max": max(gather.max_batch for gather in gathers)} if gathers else {}
