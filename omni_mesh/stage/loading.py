"""A replica's default id. (Its handler comes from `omni_mesh.topology.load_handler`, which
`omni-mesh validate` imports without the stage runtime.)"""

from __future__ import annotations

import os

from omni_mesh.hostinfo import namespace

#: The initial PID namespace (the kernel's PROC_PID_INIT_INO): a process outside any container.
_INITIAL_PID_NAMESPACE = "pid:[4026531836]"


def default_replica_id(stage: str, host: str) -> str:
    """`stage-host-pid`, plus the PID namespace inside a container: pids there repeat from one
    container to the next, and containers on the host network all carry the host's name, so
    `--scale` would otherwise give every replica the same id."""
    pidns = namespace("pid")
    suffix = (
        f"-{pidns.removeprefix('pid:[').rstrip(']')}" if pidns not in ("", _INITIAL_PID_NAMESPACE) else ""
    )
    return f"{stage}-{host}-{os.getpid()}{suffix}"
