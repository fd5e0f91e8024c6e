"""A replica's runner frees a request's slot however the request ends, even aborted before it began."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

from omni_mesh.control import Work
from omni_mesh.handlers import HandlerHooks
from omni_mesh.stage.runner import Runner


async def _slow(inputs, ctx):
    await asyncio.sleep(30)
    return inputs


def _runner(sent: list, freed: list) -> Runner:
    async def send(message, *extra) -> None:
        sent.append(message)

    return Runner(
        "s0",
        "s0-1",
        _slow,
        HandlerHooks(),
        {},
        in_edges={},
        out_edges={},
        is_final=True,
        executor=ThreadPoolExecutor(1),
        send=send,
        freed=lambda: freed.append(1),
    )


async def test_an_abort_read_with_its_work_frees_the_slot() -> None:
    # After a reconnect a replica reads a request's Work and its Abort in one batch: the task is
    # cancelled before its first step, so nothing in its body runs. Its slot must be free all the same,
    # or a draining replica waits for it until the latest deadline it ever saw.
    sent: list = []
    freed: list = []
    runner = _runner(sent, freed)
    runner.start(Work("r1", "s0", {}, remaining_s=30.0, inputs="x"))
    runner.abort("r1")  # no await between the two, as when both messages were already queued
    for _ in range(5):
        await asyncio.sleep(0)
    assert runner.work == {} and freed == [1]
    assert sent == []  # the coordinator answered the client already: nothing more to say


async def test_a_request_sent_again_keeps_its_slot_when_the_first_run_ends() -> None:
    sent: list = []
    freed: list = []
    runner = _runner(sent, freed)
    runner.start(Work("r1", "s0", {}, remaining_s=30.0, inputs="x"))
    first = runner.work["r1"]
    runner.abort("r1")
    runner.start(Work("r1", "s0", {}, remaining_s=30.0, inputs="x"))  # sent again after a dropped connection
    again = runner.work["r1"]
    for _ in range(5):
        await asyncio.sleep(0)
    assert first.task.done() and runner.work == {"r1": again} and freed == [1]
    runner.abort("r1")
    for _ in range(5):
        await asyncio.sleep(0)
    assert runner.work == {} and freed == [1, 1]
