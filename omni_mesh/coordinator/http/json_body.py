"""A JSON answer sent as it is encoded, so a large one is never held whole in memory several times.

Encoded whole, a 10 MB bytes output became a bytes copy, a base64 str, the JSON str, its UTF-8 bytes
and the transport's copy of what the socket did not take at once: about 26 MB held per 10 MB answer
until the client had read it. Here an answer whose large leaves (bytes, tensors, arrays) add up to
`STREAM_FROM_BYTES` or more is written as a chunked body: base64 and number lists are made a slice
at a time, and a chunk goes out only when the client has taken the previous ones (uvicorn waits for
the write buffer to drain), so what is held is the stage's output and a chunk or two. The text is
the same as `JSONResponse(jsonable(content))` would send; smaller answers are sent just that way.
"""

from __future__ import annotations

import base64
import contextlib
import functools
import json
from collections.abc import Generator, Iterator
from typing import TYPE_CHECKING, Any

import numpy as np
from fastapi.responses import JSONResponse, Response, StreamingResponse

from omni_mesh.coordinator.http.jsonable import jsonable
from omni_mesh.lazy_torch import tensor_class

if TYPE_CHECKING:
    import torch

#: Answers with fewer bytes than this in large leaves are encoded whole (one write, a Content-Length).
STREAM_FROM_BYTES = 1 << 20
#: Text gathered into one chunk of the body before it is written.
CHUNK_CHARS = 256 * 1024
#: Bytes turned into base64 at a time (a multiple of 3, so the slices' base64 strings join up).
BASE64_SLICE = 3 * 64 * 1024
#: Tensor or array elements turned into a number list at a time.
ITEMS_SLICE = 8 * 1024  # about 200 KB of text for float64 values at worst

# JSONResponse's own encoding, so a streamed answer reads exactly as a whole one.
_dumps = functools.partial(json.dumps, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
_BYTES = (bytes, bytearray, memoryview)


def json_answer(content: Any) -> Response:
    """`content` (stage outputs as they are, not yet jsonable) as a JSON response."""
    if _leaf_bytes(content) < STREAM_FROM_BYTES:
        return JSONResponse(jsonable(content))
    return _Streamed(json_chunks(content))


class _Streamed(StreamingResponse):
    """A streamed answer that lets go of its content the moment it ends, sent or cut off."""

    def __init__(self, chunks: Generator[bytes, None, None]) -> None:
        super().__init__(chunks, media_type="application/json")
        self._chunks = chunks

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            # A client that went away leaves this response in a reference cycle (through the
            # cancellation's traceback), which only the cyclic GC frees, maybe minutes later:
            # closing the generator drops the answer it holds now.
            with contextlib.suppress(ValueError):  # still running in its thread: it ends by itself
                self._chunks.close()


def json_chunks(content: Any) -> Generator[bytes, None, None]:
    """The UTF-8 JSON text of `jsonable(content)`, in chunks of about CHUNK_CHARS."""
    pieces: list[str] = []
    size = 0
    for piece in _pieces(content):
        pieces.append(piece)
        size += len(piece)
        if size >= CHUNK_CHARS:
            yield "".join(pieces).encode("utf-8")
            pieces, size = [], 0
    if pieces:
        yield "".join(pieces).encode("utf-8")


def _leaf_bytes(value: Any) -> int:
    """How many bytes the bytes, tensors and arrays in `value` hold (what makes an answer large)."""
    if isinstance(value, dict):
        return sum(_leaf_bytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(_leaf_bytes(v) for v in value)
    if isinstance(value, _BYTES):
        return memoryview(value).nbytes
    if isinstance(value, tensor_class()):
        return value.numel() * value.element_size()
    if isinstance(value, np.ndarray):
        return value.nbytes
    return 0


def _pieces(value: Any) -> Iterator[str]:
    if isinstance(value, dict):
        yield "{"
        for i, (key, item) in enumerate(value.items()):
            yield ("," if i else "") + _dumps(str(key)) + ":"
            yield from _pieces(item)
        yield "}"
    elif isinstance(value, (list, tuple)):
        yield "["
        for i, item in enumerate(value):
            if i:
                yield ","
            yield from _pieces(item)
        yield "]"
    elif isinstance(value, _BYTES) and memoryview(value).nbytes > BASE64_SLICE:
        yield from _base64(value)
    elif isinstance(value, (tensor_class(), np.ndarray)) and value.ndim > 0 and _numel(value) > ITEMS_SLICE:
        yield from _array(value)
    else:  # small, or a kind jsonable converts as a whole (sets, images, numbers, text)
        yield _dumps(jsonable(value))


def _base64(value: bytes | bytearray | memoryview) -> Iterator[str]:
    view = memoryview(value)
    if not view.c_contiguous:
        view = memoryview(view.tobytes())
    view = view.cast("B")
    yield '"'
    for start in range(0, len(view), BASE64_SLICE):
        yield base64.b64encode(view[start : start + BASE64_SLICE]).decode("ascii")
    yield '"'


def _array(value: torch.Tensor | np.ndarray) -> Iterator[str]:
    """A tensor or array as nested number lists, a group of rows at a time (rows that are large
    themselves one by one)."""
    rows = value.shape[0]
    per_row = _numel(value) // rows
    yield "["
    if per_row > ITEMS_SLICE:
        for i in range(rows):
            if i:
                yield ","
            yield from _array(value[i])
    else:
        step = max(1, ITEMS_SLICE // max(per_row, 1))
        for start in range(0, rows, step):
            text = _dumps(jsonable(value[start : start + step]))
            yield ("," if start else "") + text[1:-1]  # the group's rows, without its brackets
    yield "]"


def _numel(value: torch.Tensor | np.ndarray) -> int:
    return int(value.size) if isinstance(value, np.ndarray) else value.numel()
