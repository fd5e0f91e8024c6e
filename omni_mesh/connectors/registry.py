"""The connector registry: one record per built-in connector (imported on first use: checking a
topology or reclaiming reads the record, never a backend library or torch), and the connectors
registered at run time or through the `omni_mesh.connectors` entry-point group."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import Any

from omni_mesh.connectors import backends
from omni_mesh.connectors.base import OmniConnectorBase
from omni_mesh.connectors.config.parse import parse_config
from omni_mesh.connectors.lifecycle import Lifecycle

ENTRY_POINT_GROUP = "omni_mesh.connectors"


@dataclass(frozen=True)
class BuiltIn:
    """A built-in connector, known without importing it (test_connector_registry holds it to its class)."""

    path: str  # "module:Class", imported on first use
    config: str  # the name of its config class in omni_mesh.connectors.config
    scope: str  # "host" or "network" (OmniConnectorBase.scope)
    aliases: tuple[str, ...] = ()  # other names topologies call it by (vllm-omni's)
    lifecycle: str = ""  # "module:Class" of its Lifecycle, if it holds anything beyond its process
    backends: tuple[str, ...] = ()  # native libraries it loads (their load order: backends.py)

    @property
    def names(self) -> tuple[str, ...]:  # the class's own name first
        return (self.path.rpartition(":")[2], *self.aliases)


_P = "omni_mesh.connectors."
BUILT_INS = (
    BuiltIn(_P + "shared_memory:SharedMemoryConnector", "SharedMemoryConfig", "host",
            lifecycle=_P + "shm.lifecycle:SharedMemoryLifecycle"),
    # MooncakeConnector: vllm-omni's name for the store connector, in every version of its stage configs.
    BuiltIn(_P + "mooncake_store:MooncakeStoreConnector", "MooncakeStoreConfig", "network",
            aliases=("MooncakeConnector",), backends=("mooncake.store",)),
    # MooncakeRDMAConnector: its name before vllm-omni merged it (PR #1019, Feb 2026).
    BuiltIn(_P + "mooncake_transfer_engine:MooncakeTransferEngineConnector", "MooncakeTransferEngineConfig",
            "network", aliases=("MooncakeRDMAConnector",), backends=("mooncake.engine",)),
    BuiltIn(_P + "zmq:ZmqConnector", "ZmqConfig", "network"),
    BuiltIn(_P + "yuanrong:YuanrongConnector", "YuanrongConfig", "network", backends=("yr.datasystem",)),
    BuiltIn(_P + "yuanrong_transfer_engine:YuanrongTransferEngineConnector", "YuanrongTransferEngineConfig",
            "network", backends=("yr.datasystem",)),
    BuiltIn(_P + "mori:MoriTransferEngineConnector", "MoriConfig", "network", backends=("mori",)),
    BuiltIn(_P + "in_process:InProcessConnector", "InProcessConfig", "host"),
)  # fmt: skip
_BY_PATH = {record.path: record for record in BUILT_INS}

#: name -> "module:Class" (imported on first use) or the class itself. Tests may patch it.
registered: dict[str, str | type[OmniConnectorBase]] = {
    name: record.path for record in BUILT_INS for name in record.names
}
_entry_points_loaded = False
_imported: dict[str, Any] = {}  # "module:Class" -> what it names, once imported


def _import(path: str) -> Any:
    if path not in _imported:
        module_name, _, attr = path.partition(":")
        _imported[path] = getattr(importlib.import_module(module_name), attr)
    return _imported[path]


def _target(name: str) -> str | type[OmniConnectorBase] | None:
    global _entry_points_loaded
    if not _entry_points_loaded:
        _entry_points_loaded = True
        for entry in entry_points(group=ENTRY_POINT_GROUP):
            registered.setdefault(entry.name, entry.value)
    return registered.get(name)


def built_in(name: str) -> BuiltIn | None:  # the record of a built-in connector, under any of its names
    target = _target(name)
    return _BY_PATH.get(target) if isinstance(target, str) else None


def register_connector(name: str, cls: type[OmniConnectorBase] | str) -> None:
    """Make `name` usable in topologies. `cls` is a class or a lazy "module:Class" path."""
    if not isinstance(cls, str) and not (isinstance(cls, type) and issubclass(cls, OmniConnectorBase)):
        raise TypeError(f"connector {name!r} must subclass OmniConnectorBase, got {cls!r}")
    registered[name] = cls


def available_connectors() -> list[str]:
    _target("")  # the entry points, once
    return sorted(registered)


def connector_class(name: str) -> type[OmniConnectorBase]:
    """The class registered under `name`; ValueError listing the available names if there is none."""
    target = _target(name)
    if target is None:
        raise ValueError(
            f"unknown connector {name!r}; available connectors: {', '.join(available_connectors())}"
        )
    return _import(target) if isinstance(target, str) else target  # the path stays: it finds the record


def create_connector(name: str, config: dict[str, Any] | None = None) -> OmniConnectorBase:
    return connector_class(name)(config)


@dataclass(frozen=True)
class ConnectorType:
    """What checking a topology needs of a connector type, without creating one."""

    name: str  # the class's own name (vllm-omni's key tables are keyed by it)
    config_class: type | None  # the dataclass its `extra:` mapping is read into
    scope: str  # "host" or "network" (OmniConnectorBase.scope)
    cls: type[OmniConnectorBase] | None = None  # only for a type that is not built in: it was imported

    def validate_config(self, config: dict[str, Any] | None) -> None:  # ConnectorConfigError naming the key
        if self.cls is not None:
            self.cls.validate_config(config)  # a third-party class may check more
        else:
            parse_config(self.config_class, config, owner=self.name, warn=False)


def connector_type(name: str) -> ConnectorType:
    """The type registered under `name` (a built-in one is not imported); ValueError if there is none."""
    record = built_in(name)
    if record is not None:
        from omni_mesh.connectors import config as configs  # light: dataclasses and value checks

        return ConnectorType(record.names[0], getattr(configs, record.config), record.scope)
    cls = connector_class(name)
    return ConnectorType(cls.__name__, getattr(cls, "config_class", None), cls.scope, cls)


def lifecycle_of(name: str) -> type[Lifecycle]:
    """The lifecycle of the type registered under `name` (a built-in class is not imported)."""
    record = built_in(name)
    if record is not None:
        return _import(record.lifecycle) if record.lifecycle else Lifecycle
    return connector_class(name).lifecycle


def known_lifecycles() -> list[type[Lifecycle]]:
    """The lifecycles of the built-in types and of the registered classes imported so far, once each."""
    found = {_import(record.lifecycle) for record in BUILT_INS if record.lifecycle}
    found |= {target.lifecycle for target in registered.values() if not isinstance(target, str)}
    return sorted(found - {Lifecycle}, key=lambda lifecycle: lifecycle.__qualname__)


def creation_rank(name: str) -> int:
    """Sort key for creating several connectors in one process: backends.py's load order (unknown: 1)."""
    record = built_in(name)
    return backends.rank(record.backends) if record is not None else 1
