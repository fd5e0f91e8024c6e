"""How the connectors' pools that grow are sized (SharedMemoryConnector, ZmqConnector, Mooncake TE),
and the anonymous memory their regions map (`anonymous_map`).

A pool grows by segments or regions sized for the payload that did not fit, rounded up to GROW_STEP,
up to a ceiling: the config's `max_pool_size`, or by default a share of the memory the pool takes
from (half of /dev/shm, or of RAM for anonymous memory), at most AUTO_CEILING_MAX, and never less
than the pool's configured size. A pool maps little up front (FIRST_PART, or its configured size if
smaller) and grows as payloads need: an idle mesh holds little memory. Half leaves the rest to the host's other stage processes (each with a
pool of its own) and to one-off buffers; 8 GiB holds several of the largest payloads seen in
practice (~1-2 GiB of hidden states) without one process taking a big host's memory.
"""

from __future__ import annotations

import contextlib
import mmap
import os

from omni_mesh.connectors.pools.allocator import PAGE, round_up

GROW_STEP = 16 << 20
#: What a pool maps up front at most (its configured size if smaller): enough for a few of the usual
#: 0.5-2 MiB hand-offs; larger or more payloads grow it.
FIRST_PART = 4 << 20
AUTO_CEILING_SHARE = 0.5
AUTO_CEILING_MAX = 8 << 30


def grown_size(nbytes: int, room: int | None = None) -> int:
    """The size of a part added for `nbytes` (which include the part's own headers and alignment):
    rounded up to GROW_STEP, but within `room` (what the ceiling leaves) where `nbytes` fit in it."""
    size = round_up(nbytes, GROW_STEP)
    if room is not None and nbytes <= room < size:
        return round_up(nbytes, PAGE)
    return size


def first_part(configured: int, ceiling: int) -> int:
    """What a pool of `configured` bytes maps up front: FIRST_PART at most, unless growth under
    `ceiling` would then have too little room for a payload of `configured` bytes (all of it then)."""
    small = min(configured, FIRST_PART)
    return small if ceiling - small >= configured else configured


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


def anonymous_map(size: int, *, populate: bool = False, huge_pages: bool = True) -> mmap.mmap:
    """The memory of a pool's region: page-aligned (so 64-byte aligned slots), pre-faulted with
    `populate`; huge pages make its first touch ~5x cheaper."""
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | (mmap.MAP_POPULATE if populate else 0)
    region = mmap.mmap(-1, size, flags=flags)
    if huge_pages:
        with contextlib.suppress(AttributeError, OSError):  # no THP support: plain pages
            region.madvise(mmap.MADV_HUGEPAGE)
    return region
