"""Connector configuration: what a connector's `extra:` mapping may hold and how it is read. Light on
purpose (no backend library, no torch, no zmq): `omni-mesh validate`, `up` and `export` check
topologies with it without importing a connector.

    classes         every built-in connector's config class: its keys, defaults and `check(owner)`
    checks          what `check`s share beyond the field types (protocols, HOST:PORT addresses)
    fields          the fields' types (Int, Float, Size: numbers and sizes as vllm-omni's files write them)
                    and vllm-omni's aliases of a field (`vllm_omni(...)`)
    parse           `parse_config` (a user's `extra:` -> the config class), `ConnectorConfigError`
    values          `$VAR` expansion, and numeric strings by key name for the topology's extra:
    vllm_omni_keys  vllm-omni's other connector keys: honoured, or with no effect
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
from omni_mesh.connectors.config.fields import Float, Int, Size, parse_size, vllm_omni
from omni_mesh.connectors.config.parse import ConnectorConfigError, parse_config

__all__ = [
    "P2P",
    "InProcessConfig",
    "Float",
    "Int",
    "Size",
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
    "vllm_omni",
]
