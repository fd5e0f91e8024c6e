"""SharedMemoryConnector's lifecycle: the segments a process made in /dev/shm outlive it.

A replica's token names the /dev/shm it sees (its domain: same machine, same mount). Once its process
is confirmed gone, the coordinator unlinks its segments if it sees the same /dev/shm, under the exact
prefix derived from the process facts it verified (PID namespace, pid, start time): never from the
token, so a replica cannot make the coordinator unlink another process's memory.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from omni_mesh.connectors.lifecycle import Lifecycle, ProcessFacts
from omni_mesh.connectors.shm.segments import (
    DEFAULT_DIR,
    ENV_DIR,
    ProcessIdentity,
    list_segments,
    owner_of,
    reap_orphaned_segments,
    segment_name,
    shm_dir,
    unlink_segment,
)
from omni_mesh.hostinfo import machine_id


def shm_domain() -> str:
    """Which /dev/shm this process sees. Two processes share segments exactly when their domains are
    equal (a container with its own /dev/shm gets another one). OMNI_MESH_SHM_DOMAIN overrides it for
    setups we cannot detect."""
    override = os.environ.get("OMNI_MESH_SHM_DOMAIN")
    if override:
        return override
    try:
        device = os.stat(shm_dir()).st_dev
    except OSError:
        device = 0
    return f"{machine_id()}/{device}"


def _prefix(token: Any, process: ProcessFacts) -> str | None:
    """The prefix of the segments `process` made, when it shares our /dev/shm and can be derived."""
    if not isinstance(token, dict) or token.get("domain") != shm_domain():
        return None
    inode = process.pidns.removeprefix("pid:[").rstrip("]")
    if not inode.isdigit() or process.start == 0:
        return None
    return segment_name(ProcessIdentity(int(inode), process.pid, process.start), "")


class SharedMemoryLifecycle(Lifecycle):
    @classmethod
    def token(cls) -> dict[str, str]:
        return {"domain": shm_domain()}

    @classmethod
    def holds(cls, token: Any, process: ProcessFacts) -> bool:
        return _prefix(token, process) is not None

    @classmethod
    def reclaim(cls, token: Any, process: ProcessFacts) -> list[str]:
        prefix = _prefix(token, process)
        if prefix is None:
            return []
        return [name for name in list_segments() if name.startswith(prefix) and unlink_segment(name)]

    @classmethod
    def reclaim_orphans(cls, pid: int, env: Mapping[str, str] | None = None) -> list[str]:
        directory = Path(env.get(ENV_DIR) or DEFAULT_DIR) if env is not None else None
        return reap_orphaned_segments(pid=pid, directory=directory)

    @classmethod
    def held_by(cls, pids: set[int]) -> list[str]:
        return [
            name for name in list_segments() if (owner := owner_of(name)) is not None and owner.pid in pids
        ]

    @classmethod
    def colocated(cls, a: Any, b: Any) -> bool:
        return isinstance(a, dict) and isinstance(b, dict) and a.get("domain") == b.get("domain")
