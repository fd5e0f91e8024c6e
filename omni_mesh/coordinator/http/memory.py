"""Give the memory of large answers back to the system once they are sent.

glibc serves an allocation from mmap (unmapped as soon as it is freed) only above a threshold, and
that threshold rises to the size of the largest such block freed so far (up to 32 MiB). After the
first 10 MB answer, the next ones were carved from the heap, whose free space glibc rarely returns:
a burst of 20 large answers left the coordinator some 200 MiB larger for good. A fixed threshold
(which also stops it from moving) keeps every large block mmap'd, so a dropped answer is returned.
"""

from __future__ import annotations

import ctypes
import logging
import sys

log = logging.getLogger("omni_mesh.coordinator")

M_MMAP_THRESHOLD = -3  # glibc's <malloc.h>
MMAP_THRESHOLD_BYTES = 256 * 1024


def return_large_blocks() -> bool:
    """Fix glibc's mmap threshold for this process; False where there is no glibc to tell."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    done = bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES))
    if not done:
        log.debug("mallopt(M_MMAP_THRESHOLD) refused: large answers may stay in the heap once sent")
    return done
