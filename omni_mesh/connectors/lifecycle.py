"""What a connector type holds beyond the life of the process that made it, and how it is reclaimed.

A connector may leave something behind when its process dies (SharedMemoryConnector: segments in
/dev/shm). Only the connector type knows what, so each type has a `Lifecycle`: the replica sends the
coordinator an opaque, msgpack-able token per connector type when it registers; when the replica's
process is confirmed gone the coordinator hands the token back, with what it verified of the process
itself (`ProcessFacts`), and the type reclaims. The launcher reclaims what a child it started left
(`reclaim_orphans`). Nobody outside `omni_mesh.connectors` needs to know what is reclaimed.

A token comes from another process and is untrusted: a lifecycle checks it and takes what it removes
from the verified facts, never from the token alone. The registry functions that walk every type
(`reclaim`, `cleanup_tokens`, ...) live in `omni_mesh.connectors`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ProcessFacts:
    """A replica's process as the coordinator knows it: pid and start time (safe against pid reuse),
    PID namespace (`pid:[inode]`) and machine (boot id). Checked against this host's kernel by the
    caller before anything is reclaimed."""

    pid: int
    start: int
    pidns: str
    machine: str


class Lifecycle:
    """A connector type that holds nothing beyond its process: every hook is a no-op. Subclass it and
    set the connector class's `lifecycle` to it."""

    @classmethod
    def token(cls) -> Any:
        """In the replica's process: what the coordinator hands back to `reclaim` (msgpack-able)."""
        return None

    @classmethod
    def holds(cls, token: Any, process: ProcessFacts) -> bool:
        """Whether `process` may hold something here that this host can reclaim once it is gone."""
        return False

    @classmethod
    def reclaim(cls, token: Any, process: ProcessFacts) -> list[str]:
        """`process` is confirmed gone: release what it held; the names of what was released."""
        return []

    @classmethod
    def reclaim_orphans(cls, pid: int, env: Mapping[str, str] | None = None) -> list[str]:
        """What process `pid`, a child this host started, left behind if it is gone (found on this host
        alone, no token); the names of what was released. Leaves a live process's things alone. `env`:
        the environment `pid` ran with, where it names where its things are (default: this process's)."""
        return []

    @classmethod
    def held_by(cls, pids: set[int]) -> list[str]:
        """What the processes `pids` hold now (for leak checks and benchmarks)."""
        return []

    @classmethod
    def colocated(cls, a: Any, b: Any) -> bool:
        """Whether two replicas with tokens `a` and `b` can share a connector of this type (asked only
        of a host-scope type)."""
        return True
