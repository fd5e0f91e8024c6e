"""First-fit allocator over one contiguous region (a memory pool), with coalescing frees.

Pure bookkeeping: it hands out offsets, it never touches memory. Not thread-safe; callers lock.
"""

from __future__ import annotations

import bisect

ALIGNMENT = 64
PAGE = 4096
LARGE_FRAME = 64 * 1024  # frames this large start on a page boundary (see PoolAllocator.allocate)


def frame_alignment(nbytes: int) -> int:
    return PAGE if nbytes >= LARGE_FRAME else ALIGNMENT


def round_up(n: int, alignment: int = ALIGNMENT) -> int:
    return (n + alignment - 1) // alignment * alignment


class PoolAllocator:
    def __init__(self, size: int, start: int = 0) -> None:
        self.size = size
        self.start = start
        self.in_use = 0
        self._allocated: dict[int, tuple[int, int]] = {}  # handed-out offset -> (extent start, size)
        # Free extents sorted by offset, kept as two parallel lists for bisect.
        self._free_offsets: list[int] = [start] if size > start else []
        self._free_sizes: list[int] = [size - start] if size > start else []

    def allocate(self, nbytes: int, *, align: int = ALIGNMENT, skew: int = 0) -> int | None:
        """Offset `o` of `nbytes` with (o + skew) % align == 0, or None if no extent is large enough.

        A large frame asks for a page boundary (align=4096; skew = the size of a header that precedes
        it): the codec places large leaves at page offsets where memcpy runs fastest, which needs
        the frame's own start on a page boundary.
        """
        need = round_up(max(nbytes, 1))
        for i, extent in enumerate(self._free_sizes):
            start = self._free_offsets[i]
            offset = round_up(start + skew, align) - skew if align > ALIGNMENT else start
            taken = offset - start + need
            if extent >= taken:
                if extent == taken:
                    del self._free_offsets[i], self._free_sizes[i]
                else:
                    self._free_offsets[i] += taken
                    self._free_sizes[i] -= taken
                self._allocated[offset] = (start, taken)
                self.in_use += taken
                return offset
        return None

    def free(self, offset: int) -> None:
        offset, size = self._allocated.pop(offset)
        self.in_use -= size
        i = bisect.bisect_left(self._free_offsets, offset)
        # Merge with the following extent, then with the preceding one.
        if i < len(self._free_offsets) and offset + size == self._free_offsets[i]:
            size += self._free_sizes[i]
            del self._free_offsets[i], self._free_sizes[i]
        if i > 0 and self._free_offsets[i - 1] + self._free_sizes[i - 1] == offset:
            self._free_sizes[i - 1] += size
        else:
            self._free_offsets.insert(i, offset)
            self._free_sizes.insert(i, size)

    def extent_end(self, offset: int) -> int:
        """Where the allocation handed out at `offset` ends (its alignment slack included)."""
        start, size = self._allocated[offset]
        return start + size

    @property
    def largest_free(self) -> int:
        return max(self._free_sizes, default=0)

    def __contains__(self, offset: int) -> bool:
        return offset in self._allocated
