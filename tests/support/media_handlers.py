"""Stage handlers for the media route tests (copied next to the test's topology)."""

from __future__ import annotations

import json
from typing import Any

from omni_mesh import media
from omni_mesh.engines.text import chat_messages


async def describe(inputs: dict, ctx: Any) -> dict:
    """Every part as the handler got it (its type), each media part decoded: what a media engine sees."""
    seen = []
    for message in chat_messages({"messages": [
        {**m, "content": [p for p in m["content"] if p.get("type") != "x-custom"]} if isinstance(m["content"], list) else m
        for m in inputs["messages"]
    ]}, media=True):
        for part in message["content"] if isinstance(message["content"], list) else [{"type": "text"}]:
            if part["type"] == "text":
                seen.append("text")
                continue
            value = media.decode(part)
            shape = list(value.frames.shape) if isinstance(value, media.Video) else list(value.shape)
            seen.append(f"{part['type']}/{part['format']}{shape}")
    raw = [p.get("type") for m in inputs["messages"] if isinstance(m.get("content"), list) for p in m["content"]]
    return {"text": json.dumps({"decoded": seen, "received": raw})}


async def text_only(inputs: dict, ctx: Any) -> dict:
    """What a text-only engine does with the messages."""
    return {"text": json.dumps(chat_messages(inputs))}
