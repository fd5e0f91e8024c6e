"""One Mooncake TE write of a payload's pieces, waited for without spinning a core.

`transfer_sync_write` spins in the calling thread until the engine's own threads have moved the bytes.
Over TCP those threads (the sender here, the receiver in the consumer) need the cores themselves: on a
host with few cores the spinning caller takes one of them, and the write runs slower than the engine
can go. Here each piece is submitted (`transfer_submit_write`) and its status polled every `_POLL_S`.
The interval is short on purpose: sleeps that grew with the wait (to 1 ms) made a quiet host's 16 MiB
get 13-14 ms against 11-12 ms for sync and 50 us polls (raw TE 9.4-10.4 ms), and 20 us, 100 us and
200 us polls ranked in that order: the engine's threads go faster while this core stays awake. Under
load the short poll still leaves the core to them (docs/benchmarks.md has the figures). Nothing is
given up early: the engine may read the pieces' memory until it reports each piece done or failed (its
own timeout, MC_TRANSFER_TIMEOUT, bounds that).
"""

from __future__ import annotations

import time
from typing import Any

_DONE, _RUNNING = 1, 0
_POLL_S = 50e-6


def write(engine: Any, segment: str, sources: list[int], dests: list[int], sizes: list[int]) -> int:
    """Write each `sizes[i]` bytes at `sources[i]` to `dests[i]` in `segment`: 0 once all arrived,
    negative if the engine refused or failed one (after every submitted piece has ended)."""
    pending: list[int] = []
    rc = 0
    for source, dest, size in zip(sources, dests, sizes, strict=True):
        batch = engine.transfer_submit_write(segment, source, dest, size)
        if batch < 0:
            rc = batch
            break
        pending.append(batch)
    while pending:
        still = []
        for batch in pending:
            status = engine.transfer_check_status(batch)
            if status == _RUNNING:
                still.append(batch)
            elif status != _DONE:
                rc = rc or status
        pending = still
        if pending:
            time.sleep(_POLL_S)
    return rc
