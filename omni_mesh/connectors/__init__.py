"""Connector registry.

Built-in connectors are registered by import path and imported on first use, so importing this
package never imports a backend library (mooncake, yr.datasystem, mori). What checking a topology
needs of a type (`connector_type`: its config class and scope) comes, for a built-in one, from the
light `config` package, so `validate`, `up` and `export` import neither a backend nor torch.
Third-party connectors register through the `omni_mesh.connectors` entry-point group or
`register_connector`.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import TYPE_CHECKING, Any

from omni_mesh.connectors.base import (
    ConnectorConfigError,
    ConnectorError,
    OmniConnectorBase,
    edge_key,
    parse_config,
    parse_size,
)
from omni_mesh.connectors.config import vllm_omni_keys  # public: topology checks read it
from omni_mesh.connectors.errors import (
    ConnectorClosed,
    ConnectorFull,
    ConnectorUnavailable,
    GetAbandoned,
    PayloadMissing,
    PayloadTooLarge,
)
from omni_mesh.connectors.lifecycle import Lifecycle, ProcessFacts

if TYPE_CHECKING:
    from omni_mesh.connectors.shm.meshdir import MeshShmDir

__all__ = [
    "ConnectorClosed",
    "ConnectorConfigError",
    "ConnectorError",
    "ConnectorFull",
    "ConnectorType",
    "ConnectorUnavailable",
    "GetAbandoned",
    "Lifecycle",
    "OmniConnectorBase",
    "PayloadMissing",
    "PayloadTooLarge",
    "ProcessFacts",
    "available_connectors",
    "cleanup_tokens",
    "colocated",
    "connector_class",
    "connector_type",
    "create_connector",
    "creation_rank",
    "edge_key",
    "held_by",
    "holds",
    "lifecycle_of",
    "mesh_places",
    "parse_size",
    "reclaim",
    "reclaim_orphans",
    "vllm_omni_keys",
    "register_connector",
]

ENTRY_POINT_GROUP = "omni_mesh.connectors"

# name -> "module:Class" (built-ins, imported lazily) or the class itself (registered at run time).
_REGISTRY: dict[str, str | type[OmniConnectorBase]] = {
    "SharedMemoryConnector": "omni_mesh.connectors.shared_memory:SharedMemoryConnector",
    "MooncakeStoreConnector": "omni_mesh.connectors.mooncake_store:MooncakeStoreConnector",
    # vllm-omni's name for the store connector, in every version of its stage configs.
    "MooncakeConnector": "omni_mesh.connectors.mooncake_store:MooncakeStoreConnector",
    "MooncakeTransferEngineConnector": "omni_mesh.connectors.mooncake_transfer_engine:MooncakeTransferEngineConnector",
    # The same connector under the name it had before vllm-omni merged it (PR #1019, Feb 2026).
    "MooncakeRDMAConnector": "omni_mesh.connectors.mooncake_transfer_engine:MooncakeTransferEngineConnector",
    "ZmqConnector": "omni_mesh.connectors.zmq:ZmqConnector",
    "YuanrongConnector": "omni_mesh.connectors.yuanrong:YuanrongConnector",
    "YuanrongTransferEngineConnector": "omni_mesh.connectors.yuanrong_transfer_engine:YuanrongTransferEngineConnector",
    "MoriTransferEngineConnector": "omni_mesh.connectors.mori:MoriTransferEngineConnector",
    "InProcessConnector": "omni_mesh.connectors.in_process:InProcessConnector",
}
# Each built-in class's config class (in omni_mesh.connectors.config) and scope, so a topology is
# checked without importing the class; test_connector_registry holds them to the classes' own.
_BUILT_IN_TYPES: dict[str, tuple[str, str]] = {
    "omni_mesh.connectors.shared_memory:SharedMemoryConnector": ("SharedMemoryConfig", "host"),
    "omni_mesh.connectors.mooncake_store:MooncakeStoreConnector": ("MooncakeStoreConfig", "network"),
    "omni_mesh.connectors.mooncake_transfer_engine:MooncakeTransferEngineConnector": (
        "MooncakeTransferEngineConfig",
        "network",
    ),
    "omni_mesh.connectors.zmq:ZmqConnector": ("ZmqConfig", "network"),
    "omni_mesh.connectors.yuanrong:YuanrongConnector": ("YuanrongConfig", "network"),
    "omni_mesh.connectors.yuanrong_transfer_engine:YuanrongTransferEngineConnector": (
        "YuanrongTransferEngineConfig",
        "network",
    ),
    "omni_mesh.connectors.mori:MoriTransferEngineConnector": ("MoriConfig", "network"),
    "omni_mesh.connectors.in_process:InProcessConnector": ("InProcessConfig", "host"),
}
# Each built-in class's lifecycle (a light module: no torch, no backend), so the coordinator and the
# launcher reclaim without importing the class; test_connector_lifecycle holds them to the classes' own.
_BUILT_IN_LIFECYCLES: dict[str, str] = {
    "omni_mesh.connectors.shared_memory:SharedMemoryConnector": "omni_mesh.connectors.shm.lifecycle:SharedMemoryLifecycle",
}
_entry_points_loaded = False


def register_connector(name: str, cls: type[OmniConnectorBase] | str) -> None:
    """Make `name` usable in topologies. `cls` is a class or a lazy "module:Class" path."""
    if not isinstance(cls, str) and not (isinstance(cls, type) and issubclass(cls, OmniConnectorBase)):
        raise TypeError(f"connector {name!r} must subclass OmniConnectorBase, got {cls!r}")
    _REGISTRY[name] = cls


def _load_entry_points() -> None:
    global _entry_points_loaded
    if _entry_points_loaded:
        return
    _entry_points_loaded = True
    for entry in entry_points(group=ENTRY_POINT_GROUP):
        _REGISTRY.setdefault(entry.name, entry.value)


def available_connectors() -> list[str]:
    _load_entry_points()
    return sorted(_REGISTRY)


def connector_class(name: str) -> type[OmniConnectorBase]:
    """The class registered under `name`; ValueError listing the available names if there is none."""
    _load_entry_points()
    target = _REGISTRY.get(name)
    if target is None:
        raise ValueError(f"unknown connector {name!r}; available connectors: {', '.join(available_connectors())}")
    if isinstance(target, str):
        module_name, _, attr = target.partition(":")
        target = getattr(importlib.import_module(module_name), attr)
        _REGISTRY[name] = target
    return target


@dataclass(frozen=True)
class ConnectorType:
    """What checking a topology needs of a connector type, without creating one."""

    name: str  # the class's own name (vllm-omni's key tables are keyed by it)
    config_class: type | None  # the dataclass its `extra:` mapping is read into
    scope: str  # "host" or "network" (OmniConnectorBase.scope)
    cls: type[OmniConnectorBase] | None = None  # only for a type that is not built in: it was imported

    def validate_config(self, config: dict[str, Any] | None) -> None:
        """ConnectorConfigError naming the key when `config` is not a valid `extra:` mapping."""
        if self.cls is not None:
            self.cls.validate_config(config)  # a third-party class may check more
        else:
            parse_config(self.config_class, config, owner=self.name, warn=False)


def connector_type(name: str) -> ConnectorType:
    """The type registered under `name`; a built-in one is not imported. ValueError (listing the
    available names) if there is none; ImportError if a type that is not built in fails to load."""
    _load_entry_points()
    target = _REGISTRY.get(name)
    if isinstance(target, str) and target in _BUILT_IN_TYPES:
        from omni_mesh.connectors import config as configs  # light: dataclasses and value checks

        config_name, scope = _BUILT_IN_TYPES[target]
        return ConnectorType(target.rpartition(":")[2], getattr(configs, config_name), scope)
    cls = connector_class(name)
    return ConnectorType(cls.__name__, getattr(cls, "config_class", None), cls.scope, cls)


def create_connector(name: str, config: dict[str, Any] | None = None) -> OmniConnectorBase:
    return connector_class(name)(config)


# Backends whose native libraries must load before the others in one process. Mooncake's crashes the
# process (a segfault, measured) when it loads after openYuanrong's yr.datasystem: their bundled libraries
# clash (commit 4868d03; `mooncake.common.import_mooncake` refuses that order with a clear error). So a
# process that creates connectors of several backends, such as a stage with a Mooncake edge and a
# Yuanrong edge, creates these first.
_LOADS_FIRST = ("omni_mesh.connectors.mooncake_store", "omni_mesh.connectors.mooncake_transfer_engine")


def creation_rank(name: str) -> int:
    """Sort key for creating several connectors in one process: 0 for a backend that must load before
    the others (_LOADS_FIRST), else 1. Unknown names rank 1 (create_connector reports them)."""
    _load_entry_points()
    target = _REGISTRY.get(name)
    module = target.partition(":")[0] if isinstance(target, str) else getattr(target, "__module__", "")
    return 0 if module in _LOADS_FIRST else 1


# ---------------------------------------------------------------- lifecycles (omni_mesh.connectors.lifecycle)


def _import(path: str) -> Any:
    module_name, _, attr = path.partition(":")
    return getattr(importlib.import_module(module_name), attr)


def lifecycle_of(name: str) -> type[Lifecycle]:
    """The lifecycle of the type registered under `name`; a built-in class is not imported. ValueError
    (listing the available names) if there is none."""
    _load_entry_points()
    target = _REGISTRY.get(name)
    if isinstance(target, str) and target in _BUILT_IN_TYPES:
        path = _BUILT_IN_LIFECYCLES.get(target)
        return _import(path) if path else Lifecycle
    return connector_class(name).lifecycle


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


def _known_lifecycles() -> list[type[Lifecycle]]:
    """The lifecycles of the built-in types and of the registered classes imported so far, once each."""
    found = {_import(path) for path in _BUILT_IN_LIFECYCLES.values()}
    found |= {target.lifecycle for target in _REGISTRY.values() if not isinstance(target, str)}
    return sorted(found - {Lifecycle}, key=lambda lifecycle: lifecycle.__qualname__)


def reclaim_orphans(pid: int, env: Mapping[str, str] | None = None) -> list[str]:
    """What process `pid` (a child this host started, with environment `env` where given) left behind,
    if it is gone, in every type."""
    return [item for lifecycle in _known_lifecycles() for item in lifecycle.reclaim_orphans(pid, env)]


def mesh_places(mesh: str, env: dict[str, str]) -> MeshShmDir:
    """What the connectors keep per mesh on this host, for `up`: a shared-memory directory of mesh
    `mesh`'s own, named in `env` for every process it starts (unless `env` names one already); made
    by `create()`, taken away with what is left in it by `remove()`."""
    from omni_mesh.connectors.shm.meshdir import MeshShmDir

    return MeshShmDir.for_mesh(mesh, env)


def held_by(pids: set[int]) -> list[str]:
    """What the processes `pids` hold now, in every type (leak checks, benchmarks)."""
    return [item for lifecycle in _known_lifecycles() for item in lifecycle.held_by(pids)]


def colocated(name: str, a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Whether two replicas (their register's tokens `a` and `b`) can share a connector of type `name`."""
    return lifecycle_of(name).colocated(a.get(name), b.get(name))
