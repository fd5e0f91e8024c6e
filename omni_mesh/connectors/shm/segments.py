"""Named shared-memory segments in /dev/shm that can be traced back to the process that made them.

A segment is named `omnimesh_<pidns>_<pid>_<start>_<token>[_x<n> | _p<n>]` (`_p<n>`: a segment a
pool grew by, `_x<n>`: a one-off fallback): the PID namespace inode, the
creator's pid and its start time (clock ticks since boot, from /proc) tell a reaper whether the creator
still runs, even after pid reuse; containers that share /dev/shm but not PIDs never reap each
other's segments because their PID namespaces differ. Segments are created with mode 0600.

Names are unpredictable (the token and the growth number come from `secrets`) and a name someone
else already holds is never reused: creation retries with a new name (`create_unique_segment`), so a
local user who pre-creates names cannot make puts fail. A directory other than the system's
/dev/shm (OMNI_MESH_SHM_DIR, read when first needed) must be private to this user (`check_dir`).
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import re
import secrets
import stat
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from omni_mesh.connectors.errors import ConnectorError, SharedMemoryFull
from omni_mesh.hostinfo import own_start_time, process_gone
from omni_mesh.hostinfo import process_start_time as process_start_time

ENV_DIR = "OMNI_MESH_SHM_DIR"
DEFAULT_DIR = "/dev/shm"
#: Names tried before a creation gives up: a collision with a random name is someone squatting.
CREATE_TRIES = 8
#: Growth and one-off numbers are below this (the key index keeps them in 31 bits: shm_lookup.ONE_OFF).
NUMBER_LIMIT = 1 << 31
PREFIX = "omnimesh_"
NAME_PATTERN = re.compile(r"^omnimesh_(\d+)_(\d+)_(\d+)_[0-9a-f]{8,32}(?:_[xp]\d+)?$")


def shm_dir() -> Path:
    """The directory segments live in: OMNI_MESH_SHM_DIR, else /dev/shm (read at each call, so a
    process may set it after importing omni_mesh)."""
    return Path(os.environ.get(ENV_DIR) or DEFAULT_DIR)


def check_dir(directory: Path) -> None:
    """ConnectorError unless segments may be made in `directory`: it exists, and, unless it is the
    system's /dev/shm (nobody else can make that; Kubernetes mounts it 0777), it is private to this
    user (owned by us or root, writable by nobody else) or a root-owned sticky directory."""
    named = f"{ENV_DIR}={directory}" if os.environ.get(ENV_DIR) else f"{directory} (set {ENV_DIR} to use another)"
    try:
        link = os.lstat(directory)
        info = os.stat(directory)
    except FileNotFoundError:
        raise ConnectorError(
            f"shared-memory directory {named} does not exist: create it (mode 0700, on a tmpfs such as "
            f"{DEFAULT_DIR}) or point {ENV_DIR} at one that does"
        ) from None
    if not stat.S_ISDIR(info.st_mode):
        raise ConnectorError(f"shared-memory directory {named} is not a directory")
    if directory == Path(DEFAULT_DIR):
        return
    trusted = (os.geteuid(), 0)
    mode = stat.S_IMODE(info.st_mode)
    shared_sticky = info.st_uid == 0 and mode & stat.S_ISVTX
    if link.st_uid not in trusted or info.st_uid not in trusted or (mode & 0o022 and not shared_sticky):
        raise ConnectorError(
            f"shared-memory directory {named} is owned by uid {info.st_uid} with mode {mode:o}"
            + (f" (a symlink owned by uid {link.st_uid})" if stat.S_ISLNK(link.st_mode) else "")
            + f": it must belong to this user (uid {os.geteuid()}) and be writable by nobody else "
            "(mode 0700), or another user could read, replace or squat its segments"
        )


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


def shm_capacity(*, free: bool = False) -> int:
    """Size of the shared-memory filesystem in bytes, or with `free` the bytes free on it (0 when it
    cannot be read)."""
    try:
        stats = os.statvfs(shm_dir())
    except OSError:
        return 0
    return (stats.f_bavail if free else stats.f_blocks) * stats.f_frsize


def new_token() -> str:
    return secrets.token_hex(6)


def new_number() -> int:
    """A growth or one-off segment's number: random, so its name cannot be guessed and squatted."""
    return 1 + secrets.randbelow(NUMBER_LIMIT - 1)


def owner_of(name: str) -> ProcessIdentity | None:
    match = NAME_PATTERN.match(name)
    if not match:
        return None
    pidns, pid, start = (int(g) for g in match.groups())
    return ProcessIdentity(pidns, pid, start)


def create_segment(name: str, size: int, *, populate: bool) -> mmap.mmap:
    """Create a new segment (never reuses an existing name: FileExistsError) and map it, pre-faulted
    if asked. SharedMemoryFull when the filesystem has no room; ConnectorError for a bad directory."""
    directory = shm_dir()
    check_dir(directory)
    path = directory / name
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_NOFOLLOW, 0o600)
    try:
        # Reserve the pages now (tmpfs otherwise grows on write): a full /dev/shm is then ENOSPC here,
        # not SIGBUS at some later write into the mapping.
        os.posix_fallocate(fd, 0, size)
        flags = mmap.MAP_SHARED | (mmap.MAP_POPULATE if populate else 0)
        return mmap.mmap(fd, size, flags=flags)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            os.unlink(path)
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.ENOMEM):
            raise SharedMemoryFull(str(directory), size, shm_capacity(free=True)) from exc
        raise
    finally:
        os.close(fd)


def create_unique_segment(make_name: Callable[[], str], size: int, *, populate: bool) -> tuple[str, mmap.mmap]:
    """create_segment under the first of up to CREATE_TRIES fresh names (`make_name()`) nobody holds:
    (the name, the mapping). A name already taken is someone else's file: never touched, skipped."""
    taken = []
    for _ in range(CREATE_TRIES):
        name = make_name()
        try:
            return name, create_segment(name, size, populate=populate)
        except FileExistsError:
            taken.append(name)
    raise ConnectorError(
        f"{CREATE_TRIES} fresh random segment names were all taken in {shm_dir()} (last {taken[-1]!r}): "
        "another process is squatting names there; use a private directory (OMNI_MESH_SHM_DIR, mode 0700)"
    )


def open_segment(name: str) -> mmap.mmap:
    """Map an existing segment read-write. Only names of our own pattern are accepted."""
    if not NAME_PATTERN.match(name):
        raise ValueError(f"not an omni-mesh shared-memory segment name: {name!r}")
    fd = os.open(shm_dir() / name, os.O_RDWR | os.O_NOFOLLOW)  # a planted symlink must not redirect us
    try:
        size = os.fstat(fd).st_size
        if size == 0:
            raise ValueError(f"shared-memory segment {name!r} is empty")
        return mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
    finally:
        os.close(fd)


def unlink_segment(name: str, directory: Path | None = None) -> bool:
    try:
        os.unlink((directory or shm_dir()) / name)
        return True
    except FileNotFoundError:
        return False


def list_segments(directory: Path | None = None) -> list[str]:
    """Our segments in `directory` (default: this process's, `shm_dir()`)."""
    try:
        return sorted(p.name for p in (directory or shm_dir()).iterdir() if p.name.startswith(PREFIX))
    except FileNotFoundError:
        return []


def reap_orphaned_segments(*, pid: int | None = None, directory: Path | None = None) -> list[str]:
    """Unlink segments whose creator is gone (optionally only those of `pid`; in `directory`, default
    this process's); returns their names.

    The launcher and the coordinator call this when a stage process exits or dies. Segments made in
    another PID namespace are left alone: their creator may well be alive there.
    """
    reaped = []
    for name in list_segments(directory):
        owner = owner_of(name)
        if owner is None or (pid is not None and owner.pid != pid):
            continue
        if not owner.is_alive() and unlink_segment(name, directory):
            reaped.append(name)
    return reaped
