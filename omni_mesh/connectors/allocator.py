"""First-fit allocator over one contiguous region (a memory pool), with coalescing frees.

Pure bookkeeping: it hands out offsets, it never touches memory. Not thread-safe; callers lock.
"""

from __future__ import annotations

import bisect

ALIGNMENT = 64


def round_up(n: int, alignment: int = ALIGNMENT) -> int:
    return (n + alignment - 1) // alignment * alignment


class PoolAllocator:
    def __init__(self, size: int, start: int = 0) -> None:
        self.size = size
        self.start = start
        self.in_use = 0
        self._allocated: dict[int, int] = {}  # offset -> size
        # Free extents sorted by offset, kept as two parallel lists for bisect.
        self._free_offsets: list[int] = [start] if size > start else []
        self._free_sizes: list[int] = [size - start] if size > start else []

    def allocate(self, nbytes: int) -> int | None:
        """Offset of `nbytes` (rounded up to the alignment), or None if no extent is large enough."""
        need = round_up(max(nbytes, 1))
        for i, extent in enumerate(self._free_sizes):
            if extent >= need:
                offset = self._free_offsets[i]
                if extent == need:
                    del self._free_offsets[i], self._free_sizes[i]
                else:
                    self._free_offsets[i] += need
                    self._free_sizes[i] -= need
                self._allocated[offset] = need
                self.in_use += need
                return offset
        return None

    def free(self, offset: int) -> None:
        size = self._allocated.pop(offset)
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

    @property
    def largest_free(self) -> int:
        return max(self._free_sizes, default=0)

    def __contains__(self, offset: int) -> bool:
        return offset in self._allocated
