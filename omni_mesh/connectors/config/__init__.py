"""Connector configuration: what a connector's `extra:` mapping may hold and how it is read. Light on
purpose (no backend library, no torch, no zmq): `omni-mesh validate`, `up` and `export` check
topologies with it without importing a connector.

    classes         every built-in connector's config class: its keys, defaults and `check(owner)`
    checks          the value checks those `check`s share (ports, positive numbers, addresses)
    parse           `parse_config` (a user's `extra:` -> the config class), `parse_size`, `ConnectorConfigError`
    values          `$VAR` expansion and numeric strings, as vllm-omni reads its files
    vllm_omni_keys  vllm-omni's names for connector keys: aliases, keys honoured, keys with no effect
"""

from omni_mesh.connectors.config.classes import (
    P2P,
    InProcessConfig,
    MooncakeStoreConfig,
    MooncakeTransferEngineConfig,
    MoriConfig,
    SharedMemoryConfig,
    YuanrongConfig,
    YuanrongTransferEngineConfig,
    ZmqConfig,
)
from omni_mesh.connectors.config.parse import SIZE, ConnectorConfigError, parse_config, parse_size

__all__ = [
    "P2P",
    "InProcessConfig",
    "SIZE",
    "ConnectorConfigError",
    "MooncakeStoreConfig",
    "MooncakeTransferEngineConfig",
    "MoriConfig",
    "SharedMemoryConfig",
    "YuanrongConfig",
    "YuanrongTransferEngineConfig",
    "ZmqConfig",
    "parse_config",
    "parse_size",
]
