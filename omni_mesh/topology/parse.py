"""The parser: a topology mapping (either layout) -> stages, connectors and the edges between them.

An edge may be declared in several places (`engine_input_source`, `input_connectors`,
`output_connectors`, `edges:`); the declarations are collected, merged into one edge per (src, dst)
and given their connector, then `graph` checks the graph and `connector_checks` the connectors.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omni_mesh import vllm_omni_deploy
from omni_mesh.topology import schema
from omni_mesh.topology.connector_checks import check_connectors
from omni_mesh.topology.entries import parse_connector_entry, parse_stage
from omni_mesh.topology.graph import check_graph, unconnected_warning
from omni_mesh.topology.model import (
    AUTO_CONNECTOR,
    ConnectorSpec,
    Edges,
    EdgeSpec,
    StageSpec,
    Topology,
    TopologyError,
    describe_edge,
    describe_stage,
    stage_list,
)
from omni_mesh.topology.modes import modes_warning
from omni_mesh.topology.no_effect import no_effect_warning
from omni_mesh.topology.openai import read_openai_section
from omni_mesh.topology.sections import Sections
from omni_mesh.topology.validation import validated

# An edge entry's keys; window_size and max_inflight are vllm-omni's scheduler's (its loader reads only
# from and to), accepted and ignored here.
_EDGE_KEYS = schema.known_keys(schema.EdgeEntry)
_TOP_KEYS = schema.known_keys(schema.TopologyFile)
_FROM_KEY = re.compile(schema.FROM_KEY)
_TO_KEY = re.compile(schema.TO_KEY)


def parse_topology(
    data: Any,
    *,
    source: str = "<topology>",
    base_dir: Path | None = None,
    default_name: str = "topology",
) -> Topology:
    """Validate an already-parsed topology mapping. Errors are prefixed with `source`."""
    try:
        prepared = vllm_omni_deploy.prepare(data, name=default_name, base_dir=base_dir)
        parser = _Parser(prepared.data, default_name, prepared)
        topology = parser.build(base_dir)
    except (TopologyError, vllm_omni_deploy.DeployFileError) as exc:
        raise TopologyError(f"{source}: {exc}", key_of=getattr(exc, "key_of", None)) from None
    topology.graph_from = prepared.graph_from
    topology.warnings = [*prepared.warnings, *parser.warnings]
    return topology


@dataclass
class _EdgeDecl:
    """One place in the file that declares an edge, and the connector it names there (if any)."""

    src: int
    dst: int
    connector: ConnectorSpec | None
    where: str


class _Parser:
    def __init__(
        self, data: Any, default_name: str, prepared: vllm_omni_deploy.PreparedFile | None = None
    ) -> None:
        if not isinstance(data, dict):
            raise TopologyError(
                f"a topology must be a mapping with a stages: list, got {type(data).__name__}"
            )
        self.warnings: list[str] = []
        schema.check_spelling(data, _TOP_KEYS, "top level", "other keys are vllm-omni's or ignored")
        self.data = data
        self.default_name = default_name
        self.sections = Sections(self._without_ignored_sections(data))
        self.stages: dict[int, StageSpec] = {}  # by id, in file order
        self.raw_stages: dict[int, dict] = {}
        self.connectors: dict[str, ConnectorSpec] = {}
        # Connector entries that failed to parse: an error only once an edge names them.
        self.broken_connectors: dict[str, TopologyError] = {}
        self.prepared = prepared or vllm_omni_deploy.PreparedFile(data)
        # vllm-omni's files (stage_args:, deploy files) get its loader's leniency where it ignores
        # something; omni-mesh's own layout is checked strictly.
        self.lenient = "stage_args" in data or self.prepared.is_deploy

    def _without_ignored_sections(self, data: dict) -> dict:
        """`data` less a top-level `connectors:` that is no mapping in a stage config: vllm-omni reads a
        stage config's connectors from `runtime.connectors` only, so such a section changes nothing there."""
        connectors = data.get("connectors")
        if "stage_args" not in data or connectors is None or isinstance(connectors, dict):
            return data
        self.warnings.append(
            f"connectors: is a {type(connectors).__name__}, not a mapping of connector names to "
            "{name: ..., extra: {...}}; vllm-omni reads a stage config's connectors from runtime.connectors "
            "only, so it ignores this section, and so does omni-mesh"
        )
        return {key: value for key, value in data.items() if key != "connectors"}

    # -- build -------------------------------------------------------------------------------------

    def build(self, base_dir: Path | None) -> Topology:
        name = self.data.get("name", self.default_name)
        if not isinstance(name, str) or not name:
            raise TopologyError(f"name: must be a non-empty string, got {name!r}")
        defaults = self._defaults()
        self._parse_stages(defaults)
        self._parse_connectors()
        decls = self._edge_decls()
        edges = self._merge_edges(decls)
        order = check_graph(self.stages, edges, stranded=self.warnings if self.lenient else None)
        self._note_unconnected(edges)
        self._note_modes_and_finals()
        self.warnings.extend(check_connectors(self.connectors, self.broken_connectors, self.stages, edges))
        position = {sid: index for index, sid in enumerate(order)}
        edge_list = sorted(edges.values(), key=lambda e: (position[e.src], position[e.dst]))
        topology = Topology(
            name=name,
            stages=[self.stages[sid] for sid in order],
            edges=edge_list,
            connectors=self.connectors,
            path=None,
            base_dir=base_dir,
        )
        topology.openai = read_openai_section(self.data.get("openai"), topology)
        return topology

    def _defaults(self) -> schema.Defaults:
        """`defaults:` (also under runtime:, as vllm-omni writes them)."""
        return validated(schema.Defaults, self.sections.mapping("defaults", "default"), "defaults")

    # -- stages ------------------------------------------------------------------------------------

    def _parse_stages(self, defaults: schema.Defaults) -> None:
        raw = self._stage_list()
        names: dict[str, int] = {}
        for index, entry in enumerate(raw):
            stage = parse_stage(entry, index, defaults)
            if stage.stage_id in self.stages:
                other = self.stages[stage.stage_id]
                raise TopologyError(
                    f"duplicate stage id {stage.stage_id}: stages {other.name!r} and {stage.name!r} both use it; "
                    "give each stage its own stage_id"
                )
            if stage.name in names:
                raise TopologyError(
                    f"duplicate stage name {stage.name!r}: stages {names[stage.name]} and {stage.stage_id} both "
                    "use it; give each stage its own name"
                )
            names[stage.name] = stage.stage_id
            self.stages[stage.stage_id] = stage
            self.raw_stages[stage.stage_id] = entry
            if warning := no_effect_warning(entry, stage):
                self.warnings.append(warning)
        if self.prepared.missing_graph:
            raise TopologyError(self.prepared.missing_graph)

    def _stage_list(self) -> list:
        if "stages" in self.data and "stage_args" in self.data:
            raise TopologyError(
                "both stages: and stage_args: are set; list the stages under only one of them"
            )
        key = "stage_args" if "stage_args" in self.data else "stages"
        raw = self.data.get(key)
        if raw is None:
            raise TopologyError("no stages: add a stages: list (stage_args: in vllm-omni files)")
        if not isinstance(raw, list) or not raw:
            raise TopologyError(f"{key}: must be a non-empty list of stages")
        return raw

    def describe(self, stage_id: int) -> str:
        return describe_stage(self.stages[stage_id])

    def describe_edge(self, src: int, dst: int) -> str:
        return describe_edge(self.stages, src, dst)

    # -- connectors --------------------------------------------------------------------------------

    def _parse_connectors(self) -> None:
        for ref, entry in self.sections.mapping("connectors", "connector").items():
            if not isinstance(ref, str):
                raise TopologyError(f"connector key {ref!r} must be a string")
            try:
                self.connectors[ref] = self._connector_entry(entry, ref, f"connector {ref!r}")
            except TopologyError as exc:  # vllm-omni reads a connector only when an edge names it
                self.broken_connectors[ref] = exc

    def _connector_entry(self, entry: Any, ref: str, who: str) -> ConnectorSpec:
        spec = parse_connector_entry(entry, ref, who, unknown_keys_ok=self.lenient)
        unknown = sorted(set(entry) - schema.CONNECTOR_KEYS, key=str)
        if unknown:  # only reached when lenient: vllm-omni reads name and extra, nothing else
            self.warnings.append(
                f"{who}: key(s) {', '.join(map(repr, unknown))} ignored (a connector has name: and extra:)"
            )
        return spec

    def _resolve_connector(self, value: Any, src: int, dst: int, where: str) -> ConnectorSpec | None:
        """A connector named at `where`: a ref into `connectors:`, an inline {name, extra}, or null."""
        if value is None:
            return None
        if isinstance(value, str):
            spec = self.connectors.get(value)
            if spec is None and value in self.broken_connectors:
                cause = self.broken_connectors[value]
                raise TopologyError(
                    f"{self.describe_edge(src, dst)}: {where} names connector {value!r}, which is invalid: {cause}",
                    key_of=cause.key_of,
                )
            if spec is None:
                defined = ", ".join(sorted(self.connectors)) or "none"
                raise TopologyError(
                    f"{self.describe_edge(src, dst)}: {where} names connector {value!r}, which is not defined "
                    f"under connectors: (defined: {defined}); define it there or fix the name"
                )
            return spec
        if isinstance(value, dict):
            # vllm-omni also allows the connector inline: {name: ..., extra: {...}}.
            return self._connector_entry(
                value, f"inline_{src}_{dst}", f"{self.describe_edge(src, dst)}: {where}"
            )
        raise TopologyError(
            f"{self.describe_edge(src, dst)}: {where}: a connector is a name defined under connectors: "
            f"or a {{name: ..., extra: {{...}}}} mapping, got {value!r}"
        )

    # -- edges -------------------------------------------------------------------------------------

    def _stage_ref(self, value: Any, where: str) -> int:
        """A stage named by id (or by name, in edges:) that must exist."""
        if isinstance(value, int) and not isinstance(value, bool):
            if value in self.stages:
                return value
        elif isinstance(value, str):
            for stage in self.stages.values():
                if stage.name == value:
                    return stage.stage_id
            if value.isdigit() and int(value) in self.stages:  # vllm-omni compares ids as strings
                return int(value)
        raise TopologyError(
            f"{where} names stage {value!r}, which is not defined (stages: {stage_list(self.stages.values())}); "
            "fix the reference or add the stage"
        )

    def _edge_decls(self) -> list[_EdgeDecl]:
        decls: list[_EdgeDecl] = []
        for sid, raw in self.raw_stages.items():
            decls.extend(self._stage_edge_decls(sid, raw))
        for where, entry in self.sections.edge_entries():
            decl = self._edge_entry_decl(entry, where)
            if decl is not None:
                decls.append(decl)
        return decls

    def _stage_edge_decls(self, sid: int, raw: dict) -> Iterable[_EdgeDecl]:
        """A stage's edges; parse_stage has checked the keys' shapes (schema.StageOwnKeys)."""
        who = self.describe(sid)
        for src_value in raw.get("engine_input_source") or []:
            src = self._stage_ref(src_value, f"{who}: engine_input_source")
            yield _EdgeDecl(src, sid, None, f"{who} engine_input_source")
        for key, pattern in (("input_connectors", _FROM_KEY), ("output_connectors", _TO_KEY)):
            for item, value in (raw.get(key) or {}).items():
                other = self._stage_ref(int(pattern.match(item).group(1)), f"{who}: {key}.{item}")  # type: ignore[union-attr]
                src, dst = (other, sid) if key == "input_connectors" else (sid, other)
                where = f"{who} {key}.{item}"
                yield _EdgeDecl(src, dst, self._resolve_connector(value, src, dst, where), where)

    def _edge_entry_decl(self, entry: Any, where: str) -> _EdgeDecl | None:
        """One edges: entry. In vllm-omni's files such an entry only picks the connector of an edge
        (engine_input_source carries the data), and its loader skips what it cannot use: so do we,
        with a warning."""
        unknown = sorted(set(entry) - _EDGE_KEYS, key=str) if isinstance(entry, dict) else []
        meant = schema.near_miss(unknown[0], _EDGE_KEYS) if unknown else None
        hint = f"; did you mean {meant!r} for {unknown[0]!r}?" if meant else ""
        if not isinstance(entry, dict) or entry.get("from") is None or entry.get("to") is None:
            message = f"{where}: an edge is a mapping {{from: <stage>, to: <stage>}}, got {entry!r}{hint}"
            return self._skip_edge(message, "skipped")
        if unknown:
            keys = ", ".join(map(repr, unknown))
            message = f"{where}: unknown key(s) {keys} in edge entry{hint} (allowed: connector, from, to)"
            self._skip_edge(message, "ignored")
        try:
            edge = validated(schema.EdgeEntry, {key: entry[key] for key in entry if key in _EDGE_KEYS}, where)
            src = self._stage_ref(edge.src, f"{where}: from")
            dst = self._stage_ref(edge.dst, f"{where}: to")
        except TopologyError as exc:
            return self._skip_edge(str(exc), "skipped: vllm-omni builds no stage for it")
        return _EdgeDecl(src, dst, self._resolve_connector(entry.get("connector"), src, dst, where), where)

    def _skip_edge(self, message: str, what: str) -> None:
        """Raise `message`, or in a vllm-omni file record it as a warning (`what` happened instead)."""
        if not self.lenient:
            raise TopologyError(message)
        self.warnings.append(f"{message}; {what}")

    def _merge_edges(self, decls: list[_EdgeDecl]) -> Edges:
        """One edge per (src, dst); every declaration that names a connector must name the same one."""
        chosen: dict[tuple[int, int], _EdgeDecl] = {}
        for decl in decls:
            key = (decl.src, decl.dst)
            first = chosen.get(key)
            if first is None or (first.connector is None and decl.connector is not None):
                chosen[key] = decl
                continue
            if decl.connector is not None and decl.connector != first.connector:
                message = (
                    f"{self.describe_edge(*key)}: {first.where} names connector {first.connector.ref!r} "
                    f"({first.connector.name}) but {decl.where} names {decl.connector.ref!r} "
                    f"({decl.connector.name}); name the same connector on both sides, or on one side only"
                )
                # vllm-omni compares only the connector types: it keeps the first (older versions the last).
                if not self.lenient or decl.connector.name != first.connector.name:
                    raise TopologyError(message)
                self.warnings.append(
                    f"{message}; {first.connector.ref!r} is used, as vllm-omni's loader does"
                )
        auto_shm = self.sections.flag("auto_shm", True)
        edges: Edges = {}
        for key, decl in sorted(chosen.items()):
            connector = decl.connector
            if connector is None:
                connector = self._auto_connector(*key, auto_shm)
            elif self.connectors.setdefault(connector.ref, connector) != connector:  # registers inline ones
                raise TopologyError(
                    f"{self.describe_edge(*key)}: {decl.where} defines an inline connector whose ref "
                    f"{connector.ref!r} is also a key under connectors:; rename that connector"
                )
            edges[key] = EdgeSpec(key[0], key[1], connector)
        return edges

    def _auto_connector(self, src: int, dst: int, auto_shm: bool) -> ConnectorSpec:
        if not auto_shm:
            raise TopologyError(
                f"{self.describe_edge(src, dst)} names no connector and auto_shm is false; name one with "
                f"input_connectors: {{from_stage_{src}: <ref>}} on {self.describe(dst)} (or "
                f"output_connectors: {{to_stage_{dst}: <ref>}} on {self.describe(src)}), or set auto_shm: true"
            )
        ref = f"auto_shm_{src}_{dst}"
        while ref in self.connectors:  # never shadow a user-defined connector of the same name
            ref += "_auto"
        spec = ConnectorSpec(ref=ref, name=AUTO_CONNECTOR, extra={}, auto=True)
        self.connectors[ref] = spec
        return spec

    def _note_unconnected(self, edges: Edges) -> None:
        """Stages without any edge each run alone; vllm-omni files mean that only with `modes:`."""
        if not self.lenient or "modes" in self.data:
            return
        warning = unconnected_warning(self.stages, edges)
        if warning is not None:
            self.warnings.append(warning)

    def _note_modes_and_finals(self) -> None:
        """vllm-omni's `modes:` (one mode's stages per deployment) and a stage config that marks no stage
        final (vllm-omni then returns nothing) are said, never silently taken another way."""
        if not self.lenient:
            return
        warning = modes_warning(self.data.get("modes"), self.stages)
        if warning is not None:
            self.warnings.append(warning)
        if (
            "stage_args" in self.data
            and len(self.stages) > 1
            and not any(s.final_output for s in self.stages.values())
        ):
            self.warnings.append(
                "no stage is marked final_output: true: vllm-omni returns the output of marked stages only, so it "
                "would return nothing; omni-mesh takes the stages with no outgoing edge as final: mark the stages "
                "whose output the client gets"
            )
