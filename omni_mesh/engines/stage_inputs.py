"""What an engine stage reads of a request beside its inputs' values: the upstream stage's chunks
whichever way they come, whether the client streams, and whether it wants audio."""

from __future__ import annotations

from collections.abc import AsyncIterable, AsyncIterator, Iterable
from typing import Any

from omni_mesh.handlers import HandlerContext


def wants_audio(ctx: HandlerContext) -> bool:
    """False when the request's params.modalities (OpenAI's) leave audio out."""
    modalities = ctx.params.get("modalities")
    return not isinstance(modalities, list) or "audio" in modalities


def client_streams(ctx: HandlerContext) -> bool:
    """Whether the client reads the reply as a stream (the runtime says: `ctx.stream`)."""
    return bool(ctx.stream)


async def chunks(inputs: Any, stage: str) -> AsyncIterator[dict]:
    """An upstream stage's chunks whichever way they come: a stream, a list, or one dict."""
    if isinstance(inputs, dict):
        items: Any = [inputs]
    else:
        items = inputs
    if isinstance(items, AsyncIterable):
        async for chunk in items:
            yield _checked(chunk, stage)
    elif isinstance(items, Iterable):
        for chunk in items:
            yield _checked(chunk, stage)
    else:
        raise ValueError(f"stage {stage!r}: inputs must be the upstream stage's chunks, got {type(inputs).__name__}")


def _checked(chunk: Any, stage: str) -> dict:
    if not isinstance(chunk, dict):
        raise ValueError(f"stage {stage!r}: an upstream chunk is a {type(chunk).__name__}, not a mapping")
    return chunk
