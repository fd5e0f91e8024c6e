"""The stage handler of `omni-mesh bench chaos`: a chain of affine maps whose result proves the path.

The entry stage turns `{"start": s, "n": n}` into the float64 tensor `s + arange(n)`; every stage
then applies `x -> 2 * x + k[stage]` (k from the request's params, distinct per stage) and appends
its name to `trail`. The maps do not commute, so the final value shows that every stage ran once,
in order, on this request's data (s is unique per request). All values are integers below 2**53:
float64 holds them exactly, so the bench compares for equality. The last stage (params["last"])
answers with a summary, not the whole tensor.
"""

from __future__ import annotations

import asyncio
from typing import Any

import torch


async def step(inputs: dict, ctx: Any) -> dict:
    params = ctx.params
    if params.get("work_s"):  # hold the request a moment, so a killed replica often holds work
        await asyncio.sleep(float(params["work_s"]))
    if "x" in inputs:
        x, trail = inputs["x"], list(inputs["trail"])
    else:
        x, trail = torch.arange(int(inputs["n"]), dtype=torch.float64) + float(inputs["start"]), []
    x = x * 2 + float(params["k"][ctx.stage])
    trail.append(ctx.stage)
    if ctx.stage != params["last"]:
        return {"x": x, "trail": trail}
    return {"trail": trail, "n": x.numel(), "head": x[:3].tolist(), "tail": x[-2:].tolist(), "sum": float(x.sum())}
