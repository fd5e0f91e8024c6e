"""A Gather (omni_mesh.engines.gather) whose model thread is held busy: what is submitted meanwhile queues,
and the next turn takes it together."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from omni_mesh.engines.gather import Gather


def held_gather(many: Callable[[list[Any]], list[Any]], max_batch: int) -> tuple[Gather, list[int], threading.Event, ThreadPoolExecutor]:
    """(the gather, the size of each call it makes, the event that frees its thread, the thread's executor)."""
    executor = ThreadPoolExecutor(max_workers=1)
    calls: list[int] = []

    def counted(items: list[Any]) -> list[Any]:
        calls.append(len(items))
        return many(items)

    busy, release = threading.Event(), threading.Event()
    executor.submit(lambda: (busy.set(), release.wait(30)))  # the model thread busy with another call
    assert busy.wait(10)
    return Gather(executor, counted, max_batch), calls, release, executor
