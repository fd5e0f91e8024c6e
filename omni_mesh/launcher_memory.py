"""How many more replicas this host's memory holds, for `omni-mesh up`'s autoscaling: a flood of
requests must not start replicas until the kernel's OOM killer picks among the mesh's processes.

A stage's replica is as large as the largest of its replicas running now (resident memory), or,
for a stage with none running yet, the largest replica of any stage (a guess at least 256 MiB). A
replica still starting counts at its stage's size: it has not grown yet. What the kernel says is
available (MemAvailable) less those still growing, less the memory `up` keeps free
(`--min-free-memory`), is what new replicas may take.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from omni_mesh.children import Child

MIB = 1024 * 1024
#: The size of a replica of a stage never measured, at least (a Python process that imported torch).
UNMEASURED_REPLICA_BYTES = 256 * MIB
#: The share of the host's memory `up` keeps free by default.
DEFAULT_FREE_SHARE = 0.1


def meminfo(field: str, path: Path = Path("/proc/meminfo")) -> int | None:
    """A /proc/meminfo field in bytes; None where there is none (not Linux)."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in path.read_text().splitlines():
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) * 1024
    return None


def resident_bytes(pid: int) -> int | None:
    """Resident memory of a process; None when it is gone (or unreadable)."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return None


def default_min_free() -> int:
    total = meminfo("MemTotal")
    return int(total * DEFAULT_FREE_SHARE) if total else 0


class MemoryRoom:
    """How many replicas of a stage the host's memory has room for now."""

    def __init__(self, min_free: int | None = None) -> None:
        self.min_free = default_min_free() if min_free is None else min_free

    def replicas(self, stage: str, children: Iterable[Child]) -> tuple[int, str]:
        """(how many more replicas of `stage` fit, a sentence saying why no more); a host whose
        memory cannot be read has room for any number (`up` runs on Linux: that is not expected)."""
        available = meminfo("MemAvailable")
        if available is None:
            return 1 << 30, ""
        sizes: dict[str, list[int]] = {}
        running = []
        for child in children:
            if child.process is not None and child.running() and (size := resident_bytes(child.process.pid)):
                sizes.setdefault(child.stage, []).append(size)
                running.append((child.stage, size))
        largest = max((max(s) for s in sizes.values()), default=0)
        size_of = {name: max(s) for name, s in sizes.items()}
        need = size_of.get(stage) or max(largest, UNMEASURED_REPLICA_BYTES)
        growing = sum(max(0, size_of.get(name, need) - size) for name, size in running)
        spare = available - growing - self.min_free
        fits = max(0, spare // need)
        why = (f"{available // MIB} MiB available, {growing // MIB} MiB still to be taken by replicas starting, "
               f"{self.min_free // MIB} MiB kept free (--min-free-memory); a replica of {stage} takes about "
               f"{need // MIB} MiB")
        return int(fits), why
