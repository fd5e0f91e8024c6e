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
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import Any

from omni_mesh.connectors.base import (
    ConnectorConfigError,
    ConnectorError,
    OmniConnectorBase,
    edge_key,
    parse_config,
    parse_size,
)

__all__ = [
    "ConnectorConfigError",
    "ConnectorError",
    "ConnectorType",
    "OmniConnectorBase",
    "available_connectors",
    "connector_class",
    "connector_type",
    "create_connector",
    "creation_rank",
    "edge_key",
    "parse_size",
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
# clash (commit 4868d03; `_mooncake_common.import_mooncake` refuses that order with a clear error). So a
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
