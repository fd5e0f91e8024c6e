"""What /proc says about processes (parents, children, CPU time, memory), for the benchmarks and the
tests. Linux only, as the rest of the mesh."""

from __future__ import annotations

import os
import shutil
from pathlib import Path


def dying_with_this_thread(argv: list[str]) -> list[str]:
    """`argv` run under util-linux's `setpriv --pdeathsig`: it gets SIGTERM when the thread that
    starts it goes. For programs that are not ours (dockerd, `ip netns exec`); ours take
    `children.PARENT_PID_ENV`. Not a `preexec_fn`: Python in a forked child can hang (children.py)."""
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        raise RuntimeError("setpriv is missing: it comes with util-linux (`apt-get install -y util-linux`)")
    return [setpriv, "--pdeathsig", "TERM", "--", *argv]


def stat_fields(pid: int) -> list[str] | None:
    """Fields of /proc/PID/stat after the command name (which may hold spaces and parentheses), from
    the state on: [0] state, [1] parent pid, [11] utime, [12] stime. None when the process is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()


def _parents() -> dict[int, list[int]]:
    parents: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit() and (fields := stat_fields(int(entry.name))):
            parents.setdefault(int(fields[1]), []).append(int(entry.name))
    return parents


def children_of(parent: int) -> set[int]:
    """Processes whose parent is `parent` now."""
    return set(_parents().get(parent, []))


def descendants(root: int) -> set[int]:
    """Every live process below `root` (children, their children, ...)."""
    parents = _parents()
    found: set[int] = set()
    todo = [root]
    while todo:
        for child in parents.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def cpu_seconds(pids: set[int]) -> float:
    """User + system CPU time the processes have used so far (those gone count 0)."""
    ticks = 0
    for pid in pids:
        if fields := stat_fields(pid):
            ticks += int(fields[11]) + int(fields[12])  # utime, stime
    return ticks / os.sysconf("SC_CLK_TCK")


def rss_bytes(pid: int) -> int:
    """Resident memory of a live process."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for pid {pid}")
