"""A torch-free no-op stage handler that counts what it runs, for the several-coordinators tests
(tests/test_coordinators.py copies this file next to its topology): the replica's own count of the
requests it works on at once, and the highest it reached, reach the tests through its heartbeats'
counters (/v1/stages)."""

from __future__ import annotations

import asyncio
from typing import Any


class Counted:
    def __init__(self) -> None:
        self.now = 0
        self.peak = 0
        self.calls = 0
        self.cancelled = 0

    @classmethod
    def from_stage(cls, options: dict) -> Counted:
        return cls()

    def counters(self) -> dict[str, int]:
        return {
            "concurrent": self.now,
            "concurrent_peak": self.peak,
            "calls_total": self.calls,
            "cancelled_total": self.cancelled,
        }

    async def __call__(self, inputs: Any, ctx: Any) -> dict:
        """Its inputs back, after `params.sleep_s` (per stage name: `params.sleep_s.<stage>`)."""
        self.calls += 1
        self.now += 1
        self.peak = max(self.peak, self.now)
        try:
            delay = (ctx.params or {}).get("sleep_s") or 0
            if isinstance(delay, dict):
                delay = delay.get(ctx.stage, 0)
            if delay:
                await asyncio.sleep(float(delay))
            return dict(inputs)
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        finally:
            self.now -= 1
