"""Named shared-memory segments in /dev/shm that can be traced back to the process that made them.

A segment is named `omnimesh_<pidns>_<pid>_<start>_<token>[_x<n> | _p<n>]` (`_p<n>`: a segment a
pool grew by, `_x<n>`: a one-off fallback): the PID namespace inode, the
creator's pid and its start time (clock ticks since boot, from /proc) tell a reaper whether the creator
still runs, even after pid reuse; containers that share /dev/shm but not PIDs never reap each
other's segments because their PID namespaces differ. Segments are created with mode 0600.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import re
import secrets
from dataclasses import dataclass
from pathlib import Path

from omni_mesh.hostinfo import ProcessUnknown as ProcessUnknown  # re-exported: process liveness is hostinfo's
from omni_mesh.hostinfo import own_start_time, process_gone
from omni_mesh.hostinfo import process_start_time as process_start_time

SHM_DIR = Path(os.environ.get("OMNI_MESH_SHM_DIR", "/dev/shm"))
PREFIX = "omnimesh_"
NAME_PATTERN = re.compile(r"^omnimesh_(\d+)_(\d+)_(\d+)_[0-9a-f]{8,32}(?:_[xp]\d+)?$")


def _pid_namespace() -> int:
    try:
        return int(re.sub(r"\D", "", os.readlink("/proc/self/ns/pid")))
    except OSError:
        return 0


@dataclass(frozen=True)
class ProcessIdentity:
    pidns: int
    pid: int
    start: int

    @classmethod
    def current(cls) -> ProcessIdentity:
        return cls(_pid_namespace(), os.getpid(), own_start_time())

    def is_alive(self) -> bool:
        """True unless we can tell for sure that the process is gone (same PID namespace only)."""
        return self.pidns != _pid_namespace() or not process_gone(self.pid, self.start)


def segment_name(identity: ProcessIdentity, token: str, suffix: str = "") -> str:
    return f"{PREFIX}{identity.pidns}_{identity.pid}_{identity.start}_{token}{suffix}"


def shm_capacity() -> int:
    """Size of the shared-memory filesystem in bytes (0 when it cannot be read)."""
    try:
        stats = os.statvfs(SHM_DIR)
    except OSError:
        return 0
    return stats.f_blocks * stats.f_frsize


def new_token() -> str:
    return secrets.token_hex(6)


def owner_of(name: str) -> ProcessIdentity | None:
    match = NAME_PATTERN.match(name)
    if not match:
        return None
    pidns, pid, start = (int(g) for g in match.groups())
    return ProcessIdentity(pidns, pid, start)


def create_segment(name: str, size: int, *, populate: bool) -> mmap.mmap:
    """Create a new segment (never reuses an existing name) and map it, pre-faulted if asked."""
    path = SHM_DIR / name
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        # Reserve the pages now (tmpfs otherwise grows on write): a full /dev/shm is then ENOSPC here,
        # not SIGBUS at some later write into the mapping.
        os.posix_fallocate(fd, 0, size)
        flags = mmap.MAP_SHARED | (mmap.MAP_POPULATE if populate else 0)
        return mmap.mmap(fd, size, flags=flags)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(path)
        raise
    finally:
        os.close(fd)


def open_segment(name: str) -> mmap.mmap:
    """Map an existing segment read-write. Only names of our own pattern are accepted."""
    if not NAME_PATTERN.match(name):
        raise ValueError(f"not an omni-mesh shared-memory segment name: {name!r}")
    fd = os.open(SHM_DIR / name, os.O_RDWR | os.O_NOFOLLOW)  # a planted symlink must not redirect us
    try:
        size = os.fstat(fd).st_size
        if size == 0:
            raise ValueError(f"shared-memory segment {name!r} is empty")
        return mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
    finally:
        os.close(fd)


def unlink_segment(name: str) -> bool:
    try:
        os.unlink(SHM_DIR / name)
        return True
    except FileNotFoundError:
        return False


def list_segments() -> list[str]:
    try:
        return sorted(p.name for p in SHM_DIR.iterdir() if p.name.startswith(PREFIX))
    except FileNotFoundError:
        return []


def reap_orphaned_segments(*, pid: int | None = None) -> list[str]:
    """Unlink segments whose creator is gone (optionally only those of `pid`); returns their names.

    The launcher and the coordinator call this when a stage process exits or dies. Segments made in
    another PID namespace are left alone: their creator may well be alive there.
    """
    reaped = []
    for name in list_segments():
        owner = owner_of(name)
        if owner is None or (pid is not None and owner.pid != pid):
            continue
        if not owner.is_alive() and unlink_segment(name):
            reaped.append(name)
    return reaped
