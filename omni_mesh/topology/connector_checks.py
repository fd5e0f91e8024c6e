"""Each connector of a topology checked against its type: the type exists and loads, and its extra:
mapping passes the type's own `validate_config`. A connector no edge uses only warns, as vllm-omni
creates only the connectors edges name."""

from __future__ import annotations

import dataclasses
import difflib

from omni_mesh.connectors import (
    ConnectorConfigError,
    ConnectorType,
    available_connectors,
    connector_type,
    vllm_omni_keys,
)
from omni_mesh.connectors.config.fields import aliases
from omni_mesh.connectors.config.values import unset_variables
from omni_mesh.topology.model import ConnectorSpec, Edges, StageSpec, TopologyError, describe_edge


def check_connectors(
    connectors: dict[str, ConnectorSpec], broken: dict[str, TopologyError], stages: dict[int, StageSpec], edges: Edges
) -> list[str]:
    """Check every connector (`broken`: the entries that failed to parse, by ref); the warnings, in order."""
    warnings: list[str] = []
    for ref, spec in connectors.items():
        users = [describe_edge(stages, *key) for key, edge in edges.items() if edge.connector.ref == ref]
        try:
            _check_connector(ref, spec, users, warnings)
        except TopologyError as exc:
            if users:
                raise
            # vllm-omni creates only the connectors edges name: an unused one cannot fail a run.
            warnings.append(f"{exc} (not an error: no edge uses it)")
    warnings.extend(f"{message} (not an error: no edge uses it)" for message in broken.values())
    return warnings


def _check_connector(ref: str, spec: ConnectorSpec, users: list[str], warnings: list[str]) -> None:
    """Its type loads and its extra: passes the type's own check; what it accepts with a caveat goes to `warnings`."""
    used = f"used by {', '.join(users)}" if users else "used by no edge"
    try:
        kind = connector_type(spec.name)
    except ValueError as exc:
        instead = vllm_omni_keys.VLLM_OMNI_ONLY.get(spec.name)
        if instead is not None and users:
            warnings.append(
                f"connector {ref!r} ({used}): {spec.name} is vllm-omni's and omni-mesh has no connector of "
                f"that name, so the graph is checked but no stage can create it; to run this file, set its "
                f"name: to {instead}"
            )
            return
        close = difflib.get_close_matches(spec.name, available_connectors(), n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise TopologyError(
            f"connector {ref!r} ({used}): {exc}; {hint}set its name: to one of those, or install "
            "the package that registers it"
        ) from None
    except ImportError as exc:
        raise TopologyError(
            f"connector {ref!r} ({used}): {spec.name} could not be imported ({exc}); "
            "install the package it needs"
        ) from None
    config = dict(spec.extra)
    fields = _config_field_names(kind)
    for key, value in spec.extra.items():
        names = unset_variables(value)
        known = key in fields or vllm_omni_keys.lookup(kind.name, key) is not None
        if names and known:  # an unknown key still fails below, by its name
            del config[key]
            warnings.append(
                f"connector {ref!r} ({used}): extra.{key} uses {', '.join('$' + n for n in names)}, which "
                "is not set here, so its value is not checked; set it wherever the stages run"
            )
    try:
        kind.validate_config(config)
    except ConnectorConfigError as exc:
        raise TopologyError(f"connector {ref!r} ({used}): {exc}; fix its extra: mapping") from None
    warnings.extend(
        f"connector {ref!r} ({used}): {message}"
        for message in vllm_omni_keys.no_effect_messages(kind.name, config, fields)
    )


def _config_field_names(kind: ConnectorType) -> set[str]:
    """The keys the type's config class reads: its fields and their vllm-omni aliases."""
    config_class = kind.config_class
    if not dataclasses.is_dataclass(config_class):
        return set()
    return {f.name for f in dataclasses.fields(config_class)} | set(aliases(config_class))
