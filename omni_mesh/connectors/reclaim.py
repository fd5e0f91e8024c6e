"""Reclaiming across every connector type the registry knows, through each one's `Lifecycle`: the
coordinator and the launcher reclaim what replicas held without importing a connector class."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from omni_mesh.connectors.lifecycle import Lifecycle, ProcessFacts
from omni_mesh.connectors.registry import known_lifecycles, lifecycle_of

if TYPE_CHECKING:
    from omni_mesh.connectors.shm.meshdir import MeshShmDir


def _lifecycles(tokens: dict[str, Any]) -> list[tuple[type[Lifecycle], Any]]:
    """(lifecycle, token) for each name in `tokens` that is a known type; a name we do not know (from
    another topology, or a forged register) reclaims nothing."""
    found = []
    for name, token in tokens.items():
        try:
            found.append((lifecycle_of(name), token))
        except (ValueError, ImportError):
            continue
    return found


def cleanup_tokens(names: list[str]) -> dict[str, Any]:
    """In a replica's process: the token of each connector type it uses, by type name (its register)."""
    return {name: lifecycle_of(name).token() for name in sorted(set(names))}


def holds(tokens: dict[str, Any], process: ProcessFacts) -> bool:
    """Whether any of the types in `tokens` may hold something of `process` this host can reclaim."""
    return any(lifecycle.holds(token, process) for lifecycle, token in _lifecycles(tokens))


def reclaim(tokens: dict[str, Any], process: ProcessFacts) -> list[str]:
    """`process` is confirmed gone (the caller checked): every type in `tokens` releases what it held."""
    return [item for lifecycle, token in _lifecycles(tokens) for item in lifecycle.reclaim(token, process)]


def reclaim_orphans(pid: int, env: Mapping[str, str] | None = None) -> list[str]:
    """What process `pid` (a child this host started, with environment `env` where given) left behind,
    if it is gone, in every type."""
    return [item for lifecycle in known_lifecycles() for item in lifecycle.reclaim_orphans(pid, env)]


def held_by(pids: set[int]) -> list[str]:
    """What the processes `pids` hold now, in every type (leak checks, benchmarks)."""
    return [item for lifecycle in known_lifecycles() for item in lifecycle.held_by(pids)]


def colocated(name: str, a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Whether two replicas (their register's tokens `a` and `b`) can share a connector of type `name`."""
    return lifecycle_of(name).colocated(a.get(name), b.get(name))


def mesh_places(mesh: str, env: dict[str, str]) -> MeshShmDir:
    """For `up`: mesh `mesh`'s own shared-memory directory on this host, named in `env` for every process
    it starts (unless `env` names one); made by `create()`, taken away with its contents by `remove()`."""
    from omni_mesh.connectors.shm.meshdir import MeshShmDir

    return MeshShmDir.for_mesh(mesh, env)
