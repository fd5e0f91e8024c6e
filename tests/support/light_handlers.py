"""Stage handlers that hold no tensor (numpy arrays, bytes, text) but one, `with_torch`, which imports
torch when it runs: the processes of a mesh of them show who loads torch (tests/test_light_processes.py)."""

from __future__ import annotations

import asyncio
import hashlib
import importlib
from typing import Any

import numpy as np


async def numbers(inputs: dict, ctx: Any) -> dict:
    """The text's digest, and `n` float64 values and as many bytes, through the edge's connector."""
    n = int(inputs["n"])
    text = inputs["text"]
    return {
        "sha": hashlib.sha256(text.encode()).hexdigest(),
        "values": np.arange(n, dtype=np.float64),
        "blob": bytes(n),
    }


async def with_torch(inputs: dict, ctx: Any) -> dict:
    """The sum of the values, taken by torch: this stage's process loads it (the positive control).
    Imported off the event loop: an import of seconds there would stop the replica's heartbeats."""
    torch = await asyncio.to_thread(importlib.import_module, "torch")
    values = inputs["values"]
    return {"sha": inputs["sha"], "sum": float(torch.from_numpy(values).sum()), "blob": inputs["blob"]}


async def summary(inputs: dict, ctx: Any) -> dict:
    return {"sha": inputs["sha"], "sum": inputs["sum"], "blob_bytes": len(inputs["blob"])}
