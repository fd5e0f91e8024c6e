"""What a replica is made from before it runs: its handler, imported from the topology's
`module:callable`, and its default replica id."""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from typing import Any

from omni_mesh.hostinfo import namespace
from omni_mesh.topology import StageSpec, Topology, add_to_sys_path

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


def load_handler(topology: Topology, stage: StageSpec) -> Callable[..., Any]:
    if not stage.handler:
        raise ValueError(
            f"stage {stage.name!r} ({stage.stage_id}) has no handler: set `handler: module:callable`"
        )
    module_name, _, attr = stage.handler.partition(":")
    if not module_name or not attr:
        raise ValueError(f"stage {stage.name!r}: handler {stage.handler!r} must look like 'module:callable'")
    add_to_sys_path(topology)
    try:
        handler = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"stage {stage.name!r}: cannot load handler {stage.handler!r}: {exc}") from exc
    if not callable(handler):
        raise ValueError(f"stage {stage.name!r}: handler {stage.handler!r} is not callable")
    return handler
