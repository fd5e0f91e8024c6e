"""A final stage's output framed for the coordinator (it rides the output's control message).

Framing goes to the I/O thread pool, off the event loop, unless the output is small and plain (a
streamed text chunk: a few strings and numbers): then it is framed on the loop, since a hop to the pool
(a thread woken, a wake-up back, and the GIL changing hands with the model thread each way) costs many
times the framing, once per streamed token.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import Executor
from typing import Any

from omni_mesh import codec, control

#: A plain output framed on the event loop holds at most this many characters (or bytes) in all.
INLINE_CHARS = 16 * 1024
_SCALARS = (int, float, bool, type(None))


async def client_frame(stage: str, value: Any, executor: Executor) -> bytes | bytearray:
    """`value` framed (codec), small plain ones on the loop; RuntimeError when the frame is larger than
    the control plane carries."""
    if _small(value):
        frame: bytes | bytearray = codec.plan(value).to_bytes()
    else:
        frame = await asyncio.get_running_loop().run_in_executor(executor, codec.encode, value)
    if len(frame) > control.MAX_FRAME_BYTES:  # the coordinator would drop our connection for it
        raise RuntimeError(
            f"stage {stage!r}: final output of {len(frame)} bytes exceeds the control plane's limit of "
            f"{control.MAX_FRAME_BYTES} bytes: return a smaller result (or a reference to where "
            "the data is stored)"
        )
    return frame


def _small(value: Any) -> bool:
    """A dict of strings, bytes and numbers (one level of dicts inside: usage), small in all: judged
    without walking anything large."""
    if type(value) is not dict or len(value) > 16:
        return False
    left = INLINE_CHARS
    for key, item in value.items():
        if type(key) is not str:
            return False
        if type(item) is dict:
            if len(item) > 16 or not all(type(k) is str and isinstance(v, _SCALARS) for k, v in item.items()):
                return False
        elif type(item) in (str, bytes):
            left -= len(item)
        elif not isinstance(item, _SCALARS):
            return False
    return left >= 0
