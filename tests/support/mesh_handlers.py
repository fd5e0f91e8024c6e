"""Stage handlers for the mesh's end-to-end tests (copied next to each test topology file).

Chain stages (`step`): the entry stage turns `{"n": N}` into a float64 tensor `arange(N)`; every
stage then appends its name to `trail` and applies `x -> 2 * x + K[stage]`, an affine map that does
not commute with the others', so the final value tells whether every stage ran, once, in order.
Request params steer misbehaviour at one stage: `{"fail": name}` raises (`{"error": "TimeoutError"}`
picks the exception; RuntimeError by default), `{"hang": name}` never
returns (and takes 0.3 s to unwind when cancelled), `{"stuck": name}` never returns and swallows
two cancellations (a clean-up stuck in a call), `{"wedge": name}` leaves a thread blocked for
10 minutes (a native call stuck in a transfer) and answers, `{"sleep": {name: seconds}}` waits first.
`Threaded` is `step` with a model thread of its own and a warm() of 2 s, as the engines have.

Graph stages (`split`, `left`, `right`, `join`, `side`): fan-out, a streaming branch, fan-in.
Stream stages (`gen`, `relay`): a streaming entry and a streaming final stage that checks order.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import random
import threading
import time
from collections.abc import AsyncIterable, AsyncIterator
from typing import Any

import torch

K = {"a": 1.0, "b": 2.0, "c": 3.0, "d": 4.0}


async def _misbehave(ctx: Any) -> None:
    params = ctx.params
    delay = (params.get("sleep") or {}).get(ctx.stage)
    if delay:
        await asyncio.sleep(float(delay))
    if params.get("fail") == ctx.stage:
        error = {"RuntimeError": RuntimeError, "TimeoutError": TimeoutError}[
            params.get("error", "RuntimeError")
        ]
        raise error(f"injected failure in {ctx.stage}")
    if params.get("wedge") == ctx.stage:
        threading.Thread(target=time.sleep, args=(600,), name="wedged").start()
    if params.get("stuck") == ctx.stage:
        # The deadline and the coordinator's abort each cancel it once: both are swallowed, as a
        # clean-up stuck in a call would; only a third cancellation ends it.
        for _ in range(2):
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.Event().wait()
        await asyncio.Event().wait()
    if params.get("hang") == ctx.stage:
        try:
            await asyncio.Event().wait()  # forever: only the deadline or an abort ends this
        finally:
            # Like a model step that runs to its end before it lets go of its inputs: cancelled
            # work holds its payloads a moment longer than the coordinator takes to abort.
            loop = asyncio.get_running_loop()
            unwound = loop.time() + 0.3
            while (left := unwound - loop.time()) > 0:
                with contextlib.suppress(asyncio.CancelledError):
                    await asyncio.sleep(left)


async def step(inputs: dict, ctx: Any) -> dict:
    await _misbehave(ctx)
    if "x" in inputs:
        x, trail = inputs["x"], list(inputs["trail"])
    else:  # the entry stage: the request's JSON inputs
        x, trail = torch.arange(int(inputs["n"]), dtype=torch.float64), []
    assert isinstance(x, torch.Tensor) and x.dtype == torch.float64, type(x)
    out = {"x": x * 2 + K[ctx.stage], "trail": [*trail, ctx.stage]}
    if ctx.stage == "d":  # the final stage answers with a summary, not the whole tensor
        y = out["x"]
        out = {"trail": out["trail"], "n": y.numel(), "head": y[:3], "tail": y[-2:], "sum": float(y.sum())}
    return out


class Threaded:
    """`step` with a model thread of its own, as the engines keep one (a ThreadPoolExecutor that stays
    idle between requests): stopping the replica must not take it for a stuck thread."""

    def __init__(self) -> None:
        from concurrent.futures import ThreadPoolExecutor

        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="model")

    @classmethod
    def from_stage(cls, options: dict) -> Threaded:
        return cls()

    async def warm(self) -> None:
        await asyncio.sleep(2.0)  # a model loading: `up` waits for the mesh to be ready meanwhile

    async def __call__(self, inputs: dict, ctx: Any) -> dict:
        await asyncio.get_running_loop().run_in_executor(self.executor, time.sleep, 0.01)
        return await step(inputs, ctx)


async def opaque(inputs: dict, ctx: Any) -> dict:
    """An output no codec can carry (an arbitrary object): its put fails, naming where."""
    return {"x": object()}


# ---------------------------------------------------------------------- fan-out, fan-in


async def split(inputs: dict, ctx: Any) -> dict:
    return {"v": torch.tensor(inputs["v"], dtype=torch.int64), "tag": inputs.get("tag", "")}


async def left(inputs: dict, ctx: Any) -> dict:
    return {"v": inputs["v"] * 10, "by": ctx.stage}


async def right(inputs: dict, ctx: Any) -> AsyncIterator[dict]:
    """Streams one chunk per element of v: {"i", "v": v[i] + 100}."""
    for i, value in enumerate(inputs["v"].tolist()):
        await asyncio.sleep(0.01)
        yield {"i": i, "v": value + 100}


async def join(inputs: dict, ctx: Any) -> dict:
    """Fan-in: {"left": left's output, "right": the list of right's chunks}."""
    assert set(inputs) == {"left", "right"}, sorted(inputs)
    chunks = inputs["right"]
    assert isinstance(chunks, list), type(chunks)
    return {"left": inputs["left"]["v"], "right": [c["v"] for c in chunks], "order": [c["i"] for c in chunks]}


async def side(inputs: Any, ctx: Any) -> dict:
    """A single-input stage after a streaming one: reads the chunks as they arrive."""
    assert isinstance(inputs, AsyncIterable), type(inputs)
    seen = [chunk["i"] async for chunk in inputs]
    return {"seen": seen, "stage": ctx.stage}


# ---------------------------------------------------------------------- streaming


async def gen(inputs: dict, ctx: Any) -> AsyncIterator[dict]:
    """Streams `count` chunks; each holds a float32 tensor of `size` elements, all equal to seq."""
    for seq in range(int(inputs["count"])):
        yield {"seq": seq, "x": torch.full((int(inputs["size"]),), float(seq), dtype=torch.float32)}


async def relay(inputs: Any, ctx: Any) -> AsyncIterator[dict]:
    """A streaming final stage: checks each chunk arrives in order, intact, and passes on a summary."""
    expected = 0
    async for chunk in inputs:
        if chunk["seq"] != expected:
            raise AssertionError(f"chunk seq {chunk['seq']} arrived when {expected} was due")
        x = chunk["x"]
        if not bool((x == float(expected)).all()):
            raise AssertionError(f"chunk {expected} holds the wrong values")
        yield {"seq": chunk["seq"], "size": x.numel(), "sum": float(x.sum())}
        expected += 1


# ---------------------------------------------------------------------- large request bodies


async def digest(inputs: dict, ctx: Any) -> dict:
    """What arrived of a large request: the text's length and SHA-256, the numbers' count and sum."""
    text = inputs.get("text", "")
    numbers = inputs.get("numbers", [])
    return {
        "text_len": len(text),
        "text_sha256": hashlib.sha256(text.encode()).hexdigest(),
        "numbers": len(numbers),
        "numbers_sum": sum(numbers),
    }


class Warmed:
    """A handler class: built once per replica from its stage's settings, warmed before it is ready."""

    def __init__(self, options: dict) -> None:
        self.options = options
        self.warmed = False

    @classmethod
    def from_stage(cls, options: dict) -> Warmed:
        return cls(options)

    async def warm(self) -> None:
        await asyncio.sleep(0.3)  # a model loading
        self.warmed = True

    async def __call__(self, inputs: dict, ctx: Any) -> dict:
        return {"warmed": self.warmed, "engine_args": self.options.get("engine_args")}


# ---------------------------------------------------------------------- large answers


async def blob(inputs: dict, ctx: Any) -> dict:
    """A large answer: `size` bytes (seeded by `seed`, so a client can check them) and their SHA-256;
    with `"tensor": true` also a float32 tensor of `size // 4` elements (i, i+1, ...)."""
    await _misbehave(ctx)
    data = random.Random(int(inputs.get("seed", 0))).randbytes(int(inputs["size"]))
    out: dict[str, Any] = {"sha256": hashlib.sha256(data).hexdigest(), "blob": data}
    if inputs.get("tensor"):
        out["tensor"] = torch.arange(int(inputs["size"]) // 4, dtype=torch.float32)
    return out
