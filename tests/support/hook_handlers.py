"""Stage handlers written as users write them today (no import of omni_mesh): a plain class with every
hook by name, an async generator, a plain function, a sync function; torch-free
(tests/test_handler_contract.py copies this file next to its topology)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any


class Hooked:
    """Every hook, none of them inherited: built from its stage, warmed, counting, and keeping `secret`
    (what only its downstream stage needs) out of the client's answer."""

    def __init__(self, options: dict) -> None:
        self.tag = options["engine_args"]["model"]
        self.warmed = False
        self.calls = 0

    @classmethod
    def from_stage(cls, options: dict) -> Hooked:
        return cls(options)

    async def warm(self) -> None:
        await asyncio.sleep(0.05)  # a model loading
        self.warmed = True

    def client_output(self, output: dict) -> dict:
        return {key: value for key, value in output.items() if key != "secret"}

    def counters(self) -> dict[str, int]:
        return {"hooked_calls_total": self.calls}

    async def __call__(self, inputs: dict, ctx: Any) -> dict:
        self.calls += 1
        return {"warmed": self.warmed, "tag": self.tag, "secret": f"for-b-{inputs['n']}", "n": inputs["n"]}


async def count_up(inputs: dict, ctx: Any) -> AsyncIterator[dict]:
    """An async generator: one chunk per number up to n, after the upstream's secret."""
    for i in range(int(inputs["n"])):
        yield {"i": i, "secret": inputs["secret"], "request_id": ctx.request_id, "stage": ctx.stage}


async def total(inputs: Any, ctx: Any) -> dict:
    """A plain async function reading a stream."""
    chunks = [chunk async for chunk in inputs]
    return {
        "sum": sum(c["i"] for c in chunks),
        "secrets": sorted({c["secret"] for c in chunks}),
        "same_request": all(c["request_id"] == ctx.request_id for c in chunks),
        "remaining_s": ctx.remaining() > 0,
    }


def echo(inputs: dict, ctx: Any) -> dict:
    """A sync function: its return value is the output."""
    return {"echo": inputs, "params": ctx.params, "replica": ctx.replica.startswith("plain-")}


class SyncWarm:
    """A warm() that is not async: refused at load, naming the stage and the hook."""

    @classmethod
    def from_stage(cls, options: dict) -> SyncWarm:
        return cls()

    def warm(self) -> None:
        pass

    async def __call__(self, inputs: dict, ctx: Any) -> dict:
        return inputs


class NoArgOutput:
    """A client_output() that takes no output: refused at load (it failed the first final answer)."""

    @classmethod
    def from_stage(cls, options: dict) -> NoArgOutput:
        return cls()

    def client_output(self) -> dict:
        return {}

    async def __call__(self, inputs: dict, ctx: Any) -> dict:
        return inputs
