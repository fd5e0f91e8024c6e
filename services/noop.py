"""No-op stage handlers: what the mesh itself costs, for `omni-mesh bench pipeline`."""

from __future__ import annotations

from typing import Any


async def passthrough(inputs: Any, ctx: Any) -> Any:
    """Return the input unchanged: the stage costs only its transfer and control overhead."""
    return inputs
