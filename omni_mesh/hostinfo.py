"""Who and where a process is, in terms other processes can compare.

- `machine_id`: the kernel's boot id. Namespace inodes repeat across machines (every host's initial PID
  namespace has the same inode), so a pid or namespace only means something next to this.
- `shm_domain`: which /dev/shm a process sees. Two processes can share shared-memory segments exactly
  when their domains are equal (same machine, same /dev/shm mount: a container with its own /dev/shm
  gets another one). OMNI_MESH_SHM_DOMAIN overrides it for setups we cannot detect.
"""

from __future__ import annotations

import os
import socket
from functools import cache

from omni_mesh.connectors.shm_segments import own_start_time, shm_dir


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


def shm_domain() -> str:
    override = os.environ.get("OMNI_MESH_SHM_DOMAIN")
    if override:
        return override
    try:
        device = os.stat(shm_dir()).st_dev
    except OSError:
        device = 0
    return f"{machine_id()}/{device}"


def process_info() -> dict[str, object]:
    """The identity a stage replica registers with."""
    return {
        "pid": os.getpid(),
        "start": own_start_time(),  # with the pid, safe against pid reuse
        "host": socket.gethostname(),
        "machine": machine_id(),
        "pidns": namespace("pid"),
        "netns": namespace("net"),
        "shm_domain": shm_domain(),
    }
