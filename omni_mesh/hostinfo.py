"""Who and where a process is, in terms other processes can compare.

- `machine_id`: the kernel's boot id. Namespace inodes repeat across machines (every host's initial PID
  namespace has the same inode), so a pid or namespace only means something next to this.
- `process_start_time` / `process_gone`: whether a process runs, safe against pid reuse, and only on
  positive evidence (a /proc we cannot read says nothing).
"""

from __future__ import annotations

import errno
import logging
import os
import socket
from functools import cache
from pathlib import Path

from omni_mesh.logs import Sparse


@cache
def machine_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return socket.gethostname()


def namespace(kind: str) -> str:
    try:
        return os.readlink(f"/proc/self/ns/{kind}")
    except OSError:
        return ""


#: What reading /proc/PID/stat fails with when the process is gone: no entry (ENOENT), or it exited
#: while being read (ESRCH). Anything else (EMFILE, EACCES, ...) says nothing about the process.
_GONE_ERRNOS = frozenset({errno.ENOENT, errno.ESRCH})
_unknown = Sparse(logging.getLogger("omni_mesh.liveness"))


class ProcessUnknown(RuntimeError):
    """Whether a process runs cannot be told: /proc could not be read (out of file descriptors, no
    permission, ...). That is no evidence about the process, so nothing may treat it as gone."""


def process_start_time(pid: int) -> int | None:
    """Start time of `pid` in clock ticks since boot; None when no such process exists (positive
    evidence: /proc has no entry for it). ProcessUnknown when /proc cannot be read (EMFILE, EACCES...)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError as exc:
        if exc.errno in _GONE_ERRNOS:
            return None
        raise ProcessUnknown(f"cannot tell whether process {pid} runs: {exc}") from exc
    try:
        # The command name may contain spaces and parentheses: fields resume after the last ')'.
        return int(stat.rsplit(")", 1)[1].split()[19])
    except (IndexError, ValueError):
        raise ProcessUnknown(f"cannot tell whether process {pid} runs: unreadable /proc/{pid}/stat") from None


def process_gone(pid: int, start: int | None = None) -> bool:
    """True only on positive evidence that the process is gone: no process `pid`, or (given its `start`)
    one that started at another time (the pid was reused). A failure to read /proc (ProcessUnknown) is
    not evidence: the process counts as alive, and the failure is logged at most once a minute."""
    try:
        now = process_start_time(pid)
    except ProcessUnknown as exc:
        _unknown.warning("%s; treating it as alive", exc)
        return False
    return now is None or (start is not None and now != start)


def own_start_time() -> int:
    """This process's start time; 0 (no identity to check liveness by) when it cannot be read."""
    try:
        return process_start_time(os.getpid()) or 0
    except ProcessUnknown:
        return 0


def process_info() -> dict[str, object]:
    """The identity a stage replica registers with."""
    return {
        "pid": os.getpid(),
        "start": own_start_time(),  # with the pid, safe against pid reuse
        "host": socket.gethostname(),
        "machine": machine_id(),
        "pidns": namespace("pid"),
        "netns": namespace("net"),
    }
