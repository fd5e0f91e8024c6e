"""Requests still running well past their deadline: a bug or a stuck call, never normal.

The runner ends each request at its deadline (its task is cancelled), so a task alive OVERDUE_S later
is stuck in its clean-up or in a call that ignores cancellation. Left alone it would count as in
flight for ever: the replica looks busy and a drain waits on it. It is cancelled again, and logged
with where it waits, so the cause can be found.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from typing import Protocol

log = logging.getLogger("omni_mesh.stage")

OVERDUE_S = 5.0


class _Running(Protocol):
    rid: str
    task: asyncio.Task | None

    @property
    def deadline(self) -> float: ...


def cancel_overdue(stage: str, running: Iterable[_Running], now: float) -> list[str]:
    """Cancel (again) the tasks of requests OVERDUE_S past their deadline (event-loop time `now`);
    the ids of those cancelled."""
    overdue = []
    for work in running:
        task = work.task
        if task is None or task.done() or now < work.deadline + OVERDUE_S:
            continue
        log.warning(
            "stage %s: request %s still running %.1f s past its deadline; cancelling it again. It waits in:\n%s",
            stage,
            work.rid,
            now - work.deadline,
            "\n".join(awaiting(task.get_coro())),
        )
        task.cancel()
        overdue.append(work.rid)
    return overdue


def awaiting(coro: object, limit: int = 12) -> list[str]:
    """Where a coroutine waits, outermost first: each frame of its chain of awaits (a task's own
    stack shows only the outermost)."""
    where = []
    while coro is not None and len(where) < limit:
        frame = getattr(coro, "cr_frame", None) or getattr(coro, "ag_frame", None) or getattr(coro, "gi_frame", None)
        if frame is not None:
            where.append(f"  {frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}")
        coro = getattr(coro, "cr_await", None) or getattr(coro, "ag_await", None) or getattr(coro, "gi_yieldfrom", None)
    return where
