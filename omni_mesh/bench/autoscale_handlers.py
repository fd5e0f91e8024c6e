"""The stage handler of `omni-mesh bench autoscale` and the autoscaling tests: it only waits, so a
replica's throughput is set by how many requests wait at once, and it imports nothing heavy.

Params: `delay_s` (seconds, or {stage: seconds}; 0.1 by default) and `bytes` (a payload of that many
bytes goes to the next stage, so an edge's connector carries something)."""

from __future__ import annotations

import asyncio
from typing import Any


async def wait(inputs: Any, ctx: Any) -> dict:
    delay = ctx.params.get("delay_s", 0.1)
    if isinstance(delay, dict):
        delay = delay.get(ctx.stage, 0.0)
    await asyncio.sleep(float(delay))
    size = int(ctx.params.get("bytes", 0))
    out: dict[str, Any] = {"replica": ctx.replica, "size": len(inputs.get("pad", b"")) if isinstance(inputs, dict) else 0}
    if size:
        out["pad"] = bytes(size)
    return out
