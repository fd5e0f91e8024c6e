"""Stage handlers for tests/test_scaling.py (copied next to each test topology).

`work` alone is a one-stage pipeline whose handler only waits (`delay_s` param, 0.1 s by default), so
its throughput is set by how many replicas wait at once. `src -> mid -> sink` moves a float32 tensor
of `n` elements (inline in the metadata when small, through the shared-memory pool when large) and
checks at the end that every element went through `mid` exactly once; `mid` waits `mid_s` and says
which replica ran it, `sink` waits `sink_s`.
"""

from __future__ import annotations

import asyncio
from typing import Any

import torch


async def work(inputs: dict, ctx: Any) -> dict:
    await asyncio.sleep(float(ctx.params.get("delay_s", 0.1)))
    return {"i": inputs.get("i"), "replica": ctx.replica}


async def src(inputs: dict, ctx: Any) -> dict:
    i = int(inputs["i"])
    return {"i": i, "x": torch.full((int(inputs["n"]),), float(i), dtype=torch.float32)}


async def mid(inputs: dict, ctx: Any) -> dict:
    await asyncio.sleep(float(ctx.params.get("mid_s", 0.1)))
    return {"i": inputs["i"], "x": inputs["x"] + 1, "by": ctx.replica}


async def sink(inputs: dict, ctx: Any) -> dict:
    await asyncio.sleep(float(ctx.params.get("sink_s", 0.0)))
    x, i = inputs["x"], inputs["i"]
    if not bool((x == float(i + 1)).all()):
        raise AssertionError(f"request {i}: the tensor does not hold {i + 1} everywhere")
    return {"i": i, "n": x.numel(), "by": inputs["by"]}
