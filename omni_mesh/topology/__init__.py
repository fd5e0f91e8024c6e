"""Topology YAML -> a validated stage graph.

A topology names its stages, the edges between them and the connector that carries payloads along
each edge. Two layouts are accepted: ours (top-level `stages:`, `connectors:`, `edges:`) and the one
vllm-omni stage configs use (`stage_args:`, with `connectors:`/`edges:` nested under `runtime:`).
vllm-omni's deploy files, which leave the graph to vllm-omni's code, get it from
`omni_mesh.vllm_omni_deploy`. Where vllm-omni's loader ignores something in its own files (a spare
connector, an edges: entry it cannot use), this package warns instead of refusing the file.
Everything is checked up front, and every error names the stages and the edge (`0->1`) involved and
says what to change, so a bad file fails at `omni-mesh validate` rather than mid-request.

The package, one concept a module:

    model             the spec dataclasses, `Topology` and `TopologyError`
    load              `load_topology` (the file and its YAML errors), `add_to_sys_path`, `load_handler`
    parse             `parse_topology`: stages, connectors and the edges declared between them
    sections          the top level and `runtime:`, where vllm-omni's files put connectors:, edges:, defaults:
    entries           one stage or connector entry, read and checked on its own
    no_effect         the vllm-omni settings of an engine stage that do nothing here, named in a warning
    graph             the order of the stages; cycles, stages that reach no final one, no edges at all
    connector_checks  each connector against its type and its type's `validate_config`
    openai            the `openai:` section, read into `omni_mesh.topology.openai_spec`'s specs
"""

from omni_mesh.topology.load import add_to_sys_path, load_handler, load_topology
from omni_mesh.topology.model import (
    AUTO_CONNECTOR,
    QUEUE_FACTOR,
    ConnectorSpec,
    EdgeSpec,
    StageSpec,
    Topology,
    TopologyError,
)
from omni_mesh.topology.parse import parse_topology

__all__ = [
    "AUTO_CONNECTOR",
    "QUEUE_FACTOR",
    "ConnectorSpec",
    "EdgeSpec",
    "StageSpec",
    "Topology",
    "TopologyError",
    "add_to_sys_path",
    "load_handler",
    "load_topology",
    "parse_topology",
]
