"""How the connectors' pools that grow are sized (SharedMemoryConnector, ZmqConnector, Mooncake TE).

A pool grows by segments or regions sized for the payload that did not fit, rounded up to GROW_STEP,
up to a ceiling: the config's `max_pool_size`, or by default a share of the memory the pool takes
from (half of /dev/shm, or of RAM for anonymous memory), at most AUTO_CEILING_MAX, and never less
than the pool's first part. Half leaves the rest to the host's other stage processes (each with a
pool of its own) and to one-off buffers; 8 GiB holds several of the largest payloads seen in
practice (~1-2 GiB of hidden states) without one process taking a big host's memory.
"""

from __future__ import annotations

import contextlib
import os

from omni_mesh.connectors.pools.allocator import PAGE, round_up

GROW_STEP = 16 << 20
AUTO_CEILING_SHARE = 0.5
AUTO_CEILING_MAX = 8 << 30


def grown_size(nbytes: int) -> int:
    """The size of a part added for `nbytes` (which include the part's own headers and alignment)."""
    return round_up(nbytes, GROW_STEP)


def ceiling(first: int, max_pool_size: int, capacity: int) -> int:
    """A pool's ceiling: `max_pool_size`, or 0 for min(half of `capacity`, AUTO_CEILING_MAX); never
    below its `first` part."""
    chosen = max_pool_size or min(int(capacity * AUTO_CEILING_SHARE), AUTO_CEILING_MAX)
    return max(chosen, round_up(first, PAGE))


def ram() -> int:
    """Physical memory in bytes (AUTO_CEILING_MAX / AUTO_CEILING_SHARE where it cannot be read)."""
    with contextlib.suppress(ValueError, OSError, AttributeError):
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return int(AUTO_CEILING_MAX / AUTO_CEILING_SHARE)
