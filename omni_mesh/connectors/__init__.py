"""omni-mesh's connectors: the contract (`base`), the exception family (`errors`), the registry of
connector types (`registry`) and reclaiming across them (`reclaim`). This module only hands their
names on; importing it imports no backend library and no torch.
"""

from __future__ import annotations

from omni_mesh.connectors.base import OmniConnectorBase
from omni_mesh.connectors.config import vllm_omni_keys  # public: topology checks read it
from omni_mesh.connectors.config.fields import parse_size
from omni_mesh.connectors.config.parse import parse_config
from omni_mesh.connectors.errors import (
    ConnectorClosed,
    ConnectorConfigError,
    ConnectorError,
    ConnectorFull,
    ConnectorUnavailable,
    GetAbandoned,
    PayloadMissing,
    PayloadTooLarge,
)
from omni_mesh.connectors.keys import edge_key
from omni_mesh.connectors.lifecycle import Lifecycle, ProcessFacts
from omni_mesh.connectors.reclaim import (
    cleanup_tokens,
    colocated,
    held_by,
    holds,
    mesh_places,
    reclaim,
    reclaim_orphans,
)
from omni_mesh.connectors.registry import (
    ENTRY_POINT_GROUP,
    ConnectorType,
    available_connectors,
    connector_class,
    connector_type,
    create_connector,
    creation_rank,
    lifecycle_of,
    register_connector,
)

__all__ = [
    "ENTRY_POINT_GROUP",
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
    "parse_config",
    "parse_size",
    "reclaim",
    "reclaim_orphans",
    "register_connector",
    "vllm_omni_keys",
]
