"""Server-sent events as the routes write them."""

from __future__ import annotations

import json
from typing import Any


def sse(data: dict[str, Any], event: str | None = None) -> str:
    """One event: `data` as JSON, under `event` when given (OpenAI's streams name none)."""
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {json.dumps(data)}\n\n"
