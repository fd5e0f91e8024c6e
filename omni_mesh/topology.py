"""Topology YAML -> a validated stage graph.

A topology names its stages, the edges between them and the connector that carries payloads along
each edge. Two layouts are accepted: ours (top-level `stages:`, `connectors:`, `edges:`) and the one
vllm-omni stage configs use (`stage_args:`, with `connectors:`/`edges:` nested under `runtime:`).
vllm-omni's deploy files, which leave the graph to vllm-omni's code, get it from
`omni_mesh.vllm_omni_deploy`. Where vllm-omni's loader ignores something in its own files (a spare
connector, an edges: entry it cannot use), this module warns instead of refusing the file.
Everything is checked up front, and every error names the stages and the edge (`0->1`) involved and
says what to change, so a bad file fails at `omni-mesh validate` rather than mid-request.
"""

from __future__ import annotations

import dataclasses
import difflib
import heapq
import re
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from omni_mesh import vllm_omni_deploy
from omni_mesh.connector_values import read_extra, unset_variables
from omni_mesh.connectors import ConnectorConfigError, available_connectors, connector_class
from omni_mesh.connectors import _vllm_omni_keys as vllm_omni_keys
from omni_mesh.openai_section import OpenAISectionError, OpenAISpec, parse_openai_section

__all__ = [
    "AUTO_CONNECTOR",
    "QUEUE_FACTOR",
    "ConnectorSpec",
    "EdgeSpec",
    "StageSpec",
    "Topology",
    "TopologyError",
    "add_to_sys_path",
    "load_topology",
    "parse_topology",
]

#: The connector created for an edge that names none (unless the file sets `auto_shm: false`).
AUTO_CONNECTOR = "SharedMemoryConnector"

#: A stage without `max_queued` holds at most this many times its total max_inflight waiting:
#: enough to keep every replica busy through a burst, small enough that a client gets 429 in time
#: to go elsewhere instead of waiting out its deadline in a queue.
QUEUE_FACTOR = 4

# Stage keys this module interprets; any other key is kept verbatim in StageSpec.options.
_STAGE_KEYS = frozenset(
    {
        "stage_id",
        "name",
        "handler",
        "replicas",
        "max_inflight",
        "max_queued",
        "final_output",
        "engine_input_source",
        "input_connectors",
        "output_connectors",
    }
)
_CONNECTOR_KEYS = frozenset({"name", "extra"})
_EDGE_KEYS = frozenset({"from", "to", "connector"})
# Edge keys vllm-omni files carry for its own scheduler; accepted and ignored here.
_IGNORED_EDGE_KEYS = frozenset({"window_size"})
_DEFAULT_KEYS = ("replicas", "max_inflight")

_FROM_KEY = re.compile(r"^from_stage_(\d+)$")
_TO_KEY = re.compile(r"^to_stage_(\d+)$")
# Stage names become compose service names, shared-memory name parts and keys of `outputs`.
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
_HANDLER = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")


class TopologyError(ValueError):
    """The topology is invalid; the message says where and what to change."""


@dataclass(frozen=True)
class ConnectorSpec:
    """One connector entry: `ref` is its key under `connectors:` (or `auto_shm_<src>_<dst>`)."""

    ref: str
    name: str
    extra: dict = field(default_factory=dict, hash=False)
    auto: bool = False


@dataclass(frozen=True)
class StageSpec:
    stage_id: int
    name: str
    handler: str | None
    replicas: int = 1
    max_inflight: int = 8
    #: Requests that may wait for a free replica of this stage; None: QUEUE_FACTOR x total max_inflight.
    max_queued: int | None = None
    final_output: bool = False
    #: Stage keys omni-mesh does not interpret (vllm-omni's engine_args, runtime, ...), kept verbatim.
    options: dict = field(default_factory=dict, hash=False)

    def queue_limit(self, running_capacity: int = 0) -> int:
        """How many requests may wait for this stage: `max_queued`, or QUEUE_FACTOR x its total
        max_inflight. `running_capacity` is the slots of the replicas registered now, which a
        compose `--scale` can make more than `replicas` x `max_inflight`; the larger one counts."""
        if self.max_queued is not None:
            return self.max_queued
        return QUEUE_FACTOR * max(self.replicas * self.max_inflight, running_capacity)


@dataclass(frozen=True)
class EdgeSpec:
    src: int
    dst: int
    connector: ConnectorSpec

    @property
    def label(self) -> str:
        return f"{self.src}->{self.dst}"


@dataclass
class Topology:
    name: str
    stages: list[StageSpec]  # in topological order (ties broken by stage id)
    edges: list[EdgeSpec]  # ordered by the topological position of (src, dst)
    connectors: dict[str, ConnectorSpec]  # by ref, auto-created ones included
    #: Things accepted as vllm-omni's loader accepts them but worth a look (validate prints them).
    warnings: list[str] = field(default_factory=list)
    #: Where the graph came from when the file left it to vllm-omni's code (a deploy file).
    graph_from: str | None = None
    path: Path | None = None
    base_dir: Path | None = None
    openai: OpenAISpec | None = None  # the optional `openai:` section (omni_mesh.openai_section)

    def stage(self, key: int | str) -> StageSpec:
        """A stage by id or by name (a digit string that is no stage name is taken as an id)."""
        for stage in self.stages:
            if stage.name == key or (
                isinstance(key, int) and not isinstance(key, bool) and stage.stage_id == key
            ):
                return stage
        if isinstance(key, str) and key.isdigit():
            return self.stage(int(key))
        raise TopologyError(
            f"topology {self.name!r} has no stage {key!r}; stages: {_stage_list(self.stages)}"
        )

    def inputs_of(self, stage_id: int | str) -> list[EdgeSpec]:
        sid = self.stage(stage_id).stage_id
        return [edge for edge in self.edges if edge.dst == sid]

    def outputs_of(self, stage_id: int | str) -> list[EdgeSpec]:
        sid = self.stage(stage_id).stage_id
        return [edge for edge in self.edges if edge.src == sid]

    @property
    def entry_stages(self) -> list[StageSpec]:
        """Stages with no input edge: they receive the request's `inputs`."""
        fed = {edge.dst for edge in self.edges}
        return [stage for stage in self.stages if stage.stage_id not in fed]

    @property
    def final_stages(self) -> list[StageSpec]:
        """Stages marked `final_output: true`; where none is marked, the stages with no output edge."""
        marked = [stage for stage in self.stages if stage.final_output]
        if marked:
            return marked
        feeding = {edge.src for edge in self.edges}
        return [stage for stage in self.stages if stage.stage_id not in feeding]

    def missing_handlers(self) -> list[StageSpec]:
        """Stages without a `handler`: fine for `validate`, refused by `up`."""
        return [stage for stage in self.stages if stage.handler is None]

    def to_dict(self) -> dict[str, Any]:
        entries = {stage.stage_id for stage in self.entry_stages}
        finals = {stage.stage_id for stage in self.final_stages}
        return {
            "name": self.name,
            "path": str(self.path) if self.path is not None else None,
            "graph_from": self.graph_from,
            "warnings": list(self.warnings),
            "stages": [
                {
                    "id": stage.stage_id,
                    "name": stage.name,
                    "handler": stage.handler,
                    "replicas": stage.replicas,
                    "max_inflight": stage.max_inflight,
                    "max_queued": stage.max_queued,
                    "final_output": stage.final_output,
                    "entry": stage.stage_id in entries,
                    "final": stage.stage_id in finals,
                }
                for stage in self.stages
            ],
            "edges": [
                {
                    "from": edge.src,
                    "to": edge.dst,
                    "label": edge.label,
                    "connector": edge.connector.ref,
                    "connector_name": edge.connector.name,
                    "auto": edge.connector.auto,
                }
                for edge in self.edges
            ],
            "connectors": {
                ref: {"name": spec.name, "extra": dict(spec.extra), "auto": spec.auto}
                for ref, spec in self.connectors.items()
            },
        }


# --------------------------------------------------------------------------------------------------
# Loading


def load_topology(path: str | Path) -> Topology:
    """Read and validate a topology file; its directory becomes the topology's `base_dir`."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise TopologyError(f"{path}: topology file not found; check the path") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise TopologyError(f"{path}: cannot read topology file: {exc}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise TopologyError(_yaml_error_message(path, exc)) from None
    if data is None:
        raise TopologyError(f"{path}: the file is empty; a topology needs at least a stages: list")
    base_dir = path.resolve().parent
    topology = parse_topology(data, source=str(path), base_dir=base_dir, default_name=path.stem)
    topology.path = path.resolve()
    return topology


def _yaml_error_message(path: Path, exc: yaml.YAMLError) -> str:
    problem_mark = getattr(exc, "problem_mark", None)
    context_mark = getattr(exc, "context_mark", None)
    mark = problem_mark or context_mark
    where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(path)
    detail = getattr(exc, "problem", None) or str(exc)
    context = getattr(exc, "context", None)
    if context and context_mark is not None and context_mark is not mark:
        detail += f" ({context} that starts at line {context_mark.line + 1})"
    elif context:
        detail += f" ({context})"
    return f"{where}: invalid YAML: {detail}; fix the syntax there"


def add_to_sys_path(topology: Topology) -> None:
    """Put the topology's directory first on sys.path, so handlers next to the file import."""
    if topology.base_dir is None:
        return
    entry = str(topology.base_dir)
    while entry in sys.path:
        sys.path.remove(entry)
    sys.path.insert(0, entry)


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
        raise TopologyError(f"{source}: {exc}") from None
    topology.graph_from = prepared.graph_from
    topology.warnings = [*prepared.warnings, *parser.warnings]
    return topology


# --------------------------------------------------------------------------------------------------
# Parsing


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
        self.data = data
        self.default_name = default_name
        self.runtime = self._runtime_section()
        self.stages: dict[int, StageSpec] = {}  # by id, in file order
        self.raw_stages: dict[int, dict] = {}
        self.connectors: dict[str, ConnectorSpec] = {}
        # Connector entries that failed to parse: an error only once an edge names them.
        self.broken_connectors: dict[str, str] = {}
        self.warnings: list[str] = []
        self.prepared = prepared or vllm_omni_deploy.PreparedFile(data)
        # vllm-omni's files (stage_args:, deploy files) get its loader's leniency where it ignores
        # something; omni-mesh's own layout is checked strictly.
        self.lenient = "stage_args" in data or self.prepared.is_deploy

    # -- sections ----------------------------------------------------------------------------------

    def _runtime_section(self) -> dict:
        runtime = self.data.get("runtime")
        if runtime is None:
            return {}
        if not isinstance(runtime, dict):
            raise TopologyError(f"runtime: must be a mapping, got {type(runtime).__name__}")
        return runtime

    def _merged_mapping(self, key: str, singular: str) -> dict:
        """`key` from the top level and from `runtime:`, merged; an item set differently in both is an error."""
        merged: dict = {}
        for where, section in ((f"{key}:", self.data), (f"runtime.{key}:", self.runtime)):
            value = section.get(key)
            if value is None:
                continue
            if not isinstance(value, dict):
                raise TopologyError(f"{where} must be a mapping, got {type(value).__name__}")
            for item, item_value in value.items():
                if item in merged and merged[item] != item_value:
                    raise TopologyError(
                        f"{singular} {item!r} is set both under {key}: and runtime.{key}: with different "
                        f"values ({merged[item]!r} vs {item_value!r}); keep only one of them"
                    )
                merged[item] = item_value
        return merged

    def _merged_flag(self, key: str, default: bool) -> bool:
        values = {where: s[key] for where, s in (("", self.data), ("runtime.", self.runtime)) if key in s}
        for where, value in values.items():
            if not isinstance(value, bool):
                raise TopologyError(f"{where}{key} must be true or false, got {value!r}")
        if len(set(values.values())) > 1:
            raise TopologyError(
                f"{key} is set both at the top level and under runtime: with different values; keep only one"
            )
        return next(iter(values.values()), default)

    def _edge_entries(self) -> list[tuple[str, Any]]:
        entries: list[tuple[str, Any]] = []
        for where, section in (("edges", self.data), ("runtime.edges", self.runtime)):
            value = section.get("edges")
            if value is None:
                continue
            if not isinstance(value, list):
                raise TopologyError(f"{where}: must be a list of {{from: <id>, to: <id>}} entries")
            entries.extend((f"{where}[{index}]", entry) for index, entry in enumerate(value))
        return entries

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
        order = self._check_graph(edges)
        self._validate_connectors(edges)
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
        try:
            topology.openai = parse_openai_section(self.data.get("openai"), topology)
        except OpenAISectionError as exc:
            raise TopologyError(str(exc)) from None
        return topology

    def _defaults(self) -> dict[str, int]:
        """`defaults: {replicas, max_inflight}` (also under runtime:, as vllm-omni writes them)."""
        merged = self._merged_mapping("defaults", "default")
        return {key: _positive_int(merged[key], f"defaults.{key}") for key in _DEFAULT_KEYS if key in merged}

    # -- stages ------------------------------------------------------------------------------------

    def _parse_stages(self, defaults: dict[str, int]) -> None:
        raw = self._stage_list()
        names: dict[str, int] = {}
        for index, entry in enumerate(raw):
            stage = _parse_stage(entry, index, defaults)
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
        return _describe(self.stages[stage_id])

    def describe_edge(self, src: int, dst: int) -> str:
        return f"edge {src}->{dst} ({self.stages[src].name} -> {self.stages[dst].name})"

    # -- connectors --------------------------------------------------------------------------------

    def _parse_connectors(self) -> None:
        for ref, entry in self._merged_mapping("connectors", "connector").items():
            if not isinstance(ref, str):
                raise TopologyError(f"connector key {ref!r} must be a string")
            try:
                self.connectors[ref] = self._connector_entry(entry, ref, f"connector {ref!r}")
            except TopologyError as exc:  # vllm-omni reads a connector only when an edge names it
                self.broken_connectors[ref] = str(exc)

    def _connector_entry(self, entry: Any, ref: str, who: str) -> ConnectorSpec:
        spec = _parse_connector_entry(entry, ref, who, unknown_keys_ok=self.lenient)
        unknown = sorted(set(entry) - _CONNECTOR_KEYS, key=str)
        if unknown:  # only reached when lenient: vllm-omni reads name and extra, nothing else
            self.warnings.append(f"{who}: key(s) {', '.join(map(repr, unknown))} ignored (a connector has name: and extra:)")
        return spec

    def _resolve_connector(self, value: Any, src: int, dst: int, where: str) -> ConnectorSpec | None:
        """A connector named at `where`: a ref into `connectors:`, an inline {name, extra}, or null."""
        if value is None:
            return None
        if isinstance(value, str):
            spec = self.connectors.get(value)
            if spec is None and value in self.broken_connectors:
                raise TopologyError(
                    f"{self.describe_edge(src, dst)}: {where} names connector {value!r}, which is invalid: "
                    f"{self.broken_connectors[value]}"
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
            return self._connector_entry(value, f"inline_{src}_{dst}", f"{self.describe_edge(src, dst)}: {where}")
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
            f"{where} names stage {value!r}, which is not defined (stages: {_stage_list(self.stages.values())}); "
            "fix the reference or add the stage"
        )

    def _edge_decls(self) -> list[_EdgeDecl]:
        decls: list[_EdgeDecl] = []
        for sid, raw in self.raw_stages.items():
            decls.extend(self._stage_edge_decls(sid, raw))
        for where, entry in self._edge_entries():
            decl = self._edge_entry_decl(entry, where)
            if decl is not None:
                decls.append(decl)
        return decls

    def _stage_edge_decls(self, sid: int, raw: dict) -> Iterable[_EdgeDecl]:
        who = self.describe(sid)
        sources = raw.get("engine_input_source")
        if sources is not None:
            if not isinstance(sources, list):
                raise TopologyError(f"{who}: engine_input_source must be a list of stage ids, e.g. [0]")
            for src_value in sources:
                src = self._stage_ref(src_value, f"{who}: engine_input_source")
                yield _EdgeDecl(src, sid, None, f"{who} engine_input_source")
        for key, (pattern, example) in (
            ("input_connectors", (_FROM_KEY, "from_stage_0")),
            ("output_connectors", (_TO_KEY, "to_stage_1")),
        ):
            mapping = raw.get(key)
            if mapping is None:
                continue
            if not isinstance(mapping, dict):
                raise TopologyError(f"{who}: {key} must be a mapping such as {{{example}: <connector>}}")
            for item, value in mapping.items():
                match = pattern.match(str(item))
                if not match:
                    raise TopologyError(
                        f"{who}: {key} key {item!r} is malformed; write {example.rsplit('_', 1)[0]}_<stage id>, "
                        f"e.g. {example}"
                    )
                other = self._stage_ref(int(match.group(1)), f"{who}: {key}.{item}")
                src, dst = (other, sid) if key == "input_connectors" else (sid, other)
                where = f"{who} {key}.{item}"
                yield _EdgeDecl(src, dst, self._resolve_connector(value, src, dst, where), where)

    def _edge_entry_decl(self, entry: Any, where: str) -> _EdgeDecl | None:
        """One edges: entry. In vllm-omni's files such an entry only picks the connector of an edge
        (engine_input_source carries the data), and its loader skips what it cannot use: so do we,
        with a warning."""
        if not isinstance(entry, dict) or entry.get("from") is None or entry.get("to") is None:
            message = f"{where}: an edge is a mapping {{from: <stage>, to: <stage>}}, got {entry!r}"
            return self._skip_edge(message, "skipped")
        unknown = sorted(set(entry) - _EDGE_KEYS - _IGNORED_EDGE_KEYS, key=str)
        if unknown:
            message = f"{where}: unknown key(s) {', '.join(map(repr, unknown))} in edge entry (allowed: connector, from, to)"
            self._skip_edge(message, "ignored")
        try:
            src = self._stage_ref(entry["from"], f"{where}: from")
            dst = self._stage_ref(entry["to"], f"{where}: to")
        except TopologyError as exc:
            return self._skip_edge(str(exc), "skipped: vllm-omni builds no stage for it")
        return _EdgeDecl(src, dst, self._resolve_connector(entry.get("connector"), src, dst, where), where)

    def _skip_edge(self, message: str, what: str) -> None:
        """Raise `message`, or in a vllm-omni file record it as a warning (`what` happened instead)."""
        if not self.lenient:
            raise TopologyError(message)
        self.warnings.append(f"{message}; {what}")

    def _merge_edges(self, decls: list[_EdgeDecl]) -> dict[tuple[int, int], EdgeSpec]:
        """One edge per (src, dst); every declaration that names a connector must name the same one."""
        chosen: dict[tuple[int, int], _EdgeDecl] = {}
        for decl in decls:
            key = (decl.src, decl.dst)
            first = chosen.get(key)
            if first is None or (first.connector is None and decl.connector is not None):
                chosen[key] = decl
                continue
            if decl.connector is not None and decl.connector != first.connector:
                raise TopologyError(
                    f"{self.describe_edge(*key)}: {first.where} names connector {first.connector.ref!r} "
                    f"({first.connector.name}) but {decl.where} names {decl.connector.ref!r} "
                    f"({decl.connector.name}); name the same connector on both sides, or on one side only"
                )
        auto_shm = self._merged_flag("auto_shm", True)
        edges: dict[tuple[int, int], EdgeSpec] = {}
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

    # -- graph -------------------------------------------------------------------------------------

    def _check_graph(self, edges: dict[tuple[int, int], EdgeSpec]) -> list[int]:
        """Topological order (ties by stage id); a cycle or a stage that reaches no final stage is an error."""
        successors: dict[int, list[int]] = {sid: [] for sid in self.stages}
        indegree = dict.fromkeys(self.stages, 0)
        for src, dst in edges:
            successors[src].append(dst)
            indegree[dst] += 1
        ready = [sid for sid, degree in indegree.items() if degree == 0]
        heapq.heapify(ready)
        order: list[int] = []
        while ready:
            sid = heapq.heappop(ready)
            order.append(sid)
            for dst in sorted(successors[sid]):
                indegree[dst] -= 1
                if indegree[dst] == 0:
                    heapq.heappush(ready, dst)
        if len(order) < len(self.stages):
            self._raise_cycle(successors, entries=[sid for sid in self.stages if not _has_input(sid, edges)])
        self._check_finals(edges, successors)
        self._note_unconnected(edges)
        return order

    def _note_unconnected(self, edges: dict[tuple[int, int], EdgeSpec]) -> None:
        """Stages without any edge each run alone; vllm-omni files mean that only with `modes:`."""
        if edges or len(self.stages) < 2 or not self.lenient or "modes" in self.data:
            return
        who = ", ".join(self.describe(sid) for sid in self.stages)
        self.warnings.append(
            f"no edge connects the stages ({who}): each is an entry and a final stage and runs alone; if they "
            "form a pipeline, give each downstream stage engine_input_source: [<upstream stage id>]"
        )

    def _raise_cycle(self, successors: dict[int, list[int]], entries: list[int]) -> None:
        cycle = _find_cycle(successors)
        members = ", ".join(self.describe(sid) for sid in dict.fromkeys(cycle))
        message = f"the stages form a cycle {'->'.join(map(str, cycle))} ({members})"
        unreached = sorted(set(self.stages) - _reachable(entries, successors))
        if unreached:
            who = ", ".join(self.describe(sid) for sid in unreached)
            message += f"; no entry stage reaches {who}"
        raise TopologyError(message + "; the stage graph must be acyclic: remove one of these edges")

    def _check_finals(self, edges: dict[tuple[int, int], EdgeSpec], successors: dict[int, list[int]]) -> None:
        finals = [sid for sid, stage in self.stages.items() if stage.final_output]
        if not finals:
            return  # every stage then reaches a sink, and sinks are the final stages
        predecessors: dict[int, list[int]] = {sid: [] for sid in self.stages}
        for src, dst in edges:
            predecessors[dst].append(src)
        stranded = sorted(set(self.stages) - _reachable(finals, predecessors))
        if stranded:
            who = ", ".join(self.describe(sid) for sid in stranded)
            final_list = ", ".join(self.describe(sid) for sid in finals)
            raise TopologyError(
                f"{who} {'reaches' if len(stranded) == 1 else 'reach'} no final stage (final: {final_list}), "
                f"so {'its' if len(stranded) == 1 else 'their'} output would be lost; connect "
                f"{'it' if len(stranded) == 1 else 'each'} to a stage that leads to a final one, or mark "
                f"{'it' if len(stranded) == 1 else 'each'} final_output: true"
            )

    # -- connector types and extra -----------------------------------------------------------------

    def _validate_connectors(self, edges: dict[tuple[int, int], EdgeSpec]) -> None:
        for ref, spec in self.connectors.items():
            users = [self.describe_edge(*key) for key, edge in edges.items() if edge.connector.ref == ref]
            try:
                self._validate_connector(ref, spec, users)
            except TopologyError as exc:
                if users:
                    raise
                # vllm-omni creates only the connectors edges name: an unused one cannot fail a run.
                self.warnings.append(f"{exc} (not an error: no edge uses it)")
        self.warnings.extend(
            f"{message} (not an error: no edge uses it)" for message in self.broken_connectors.values()
        )

    def _validate_connector(self, ref: str, spec: ConnectorSpec, users: list[str]) -> None:
        used = f"used by {', '.join(users)}" if users else "used by no edge"
        try:
            cls = connector_class(spec.name)
        except ValueError as exc:
            instead = vllm_omni_keys.VLLM_OMNI_ONLY.get(spec.name)
            if instead is not None and users:
                self.warnings.append(
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
        fields = _config_field_names(cls)
        for key, value in spec.extra.items():
            names = unset_variables(value)
            known = key in fields or vllm_omni_keys.lookup(cls.__name__, key) is not None
            if names and known:  # an unknown key still fails below, by its name
                del config[key]
                self.warnings.append(
                    f"connector {ref!r} ({used}): extra.{key} uses {', '.join('$' + n for n in names)}, which "
                    "is not set here, so its value is not checked; set it wherever the stages run"
                )
        try:
            cls.validate_config(config)
        except ConnectorConfigError as exc:
            raise TopologyError(f"connector {ref!r} ({used}): {exc}; fix its extra: mapping") from None
        self.warnings.extend(
            f"connector {ref!r} ({used}): {message}"
            for message in vllm_omni_keys.no_effect_messages(cls.__name__, config, fields)
        )


def _config_field_names(cls: type) -> set[str]:
    config_class = getattr(cls, "config_class", None)
    return {f.name for f in dataclasses.fields(config_class)} if dataclasses.is_dataclass(config_class) else set()


def _parse_stage(entry: Any, index: int, defaults: dict[str, int]) -> StageSpec:
    if not isinstance(entry, dict):
        raise TopologyError(f"stage #{index}: a stage is a mapping with a stage_id, got {entry!r}")
    if "stage_id" not in entry:
        raise TopologyError(f"stage #{index} has no stage_id; give every stage an integer stage_id")
    sid = entry["stage_id"]
    if isinstance(sid, str) and sid.isdigit():  # vllm-omni compares stage ids as strings: "1" is 1
        sid = int(sid)
    if not isinstance(sid, int) or isinstance(sid, bool) or sid < 0:
        raise TopologyError(f"stage #{index}: stage_id must be a non-negative integer, got {sid!r}")
    name = entry.get("name", f"stage_{sid}")
    if not isinstance(name, str) or not _NAME.match(name):
        raise TopologyError(
            f"stage {sid}: name must be letters, digits, '_', '.' or '-' (starting with a letter or digit), "
            f"got {name!r}"
        )
    who = f"stage {sid} {name!r}"
    handler = entry.get("handler")
    if handler is not None and (not isinstance(handler, str) or not _HANDLER.match(handler)):
        raise TopologyError(f"{who}: handler must look like 'package.module:function', got {handler!r}")
    final_output = entry.get("final_output", False)
    if not isinstance(final_output, bool):
        raise TopologyError(f"{who}: final_output must be true or false, got {final_output!r}")
    return StageSpec(
        stage_id=sid,
        name=name,
        handler=handler,
        replicas=_positive_int(entry.get("replicas", defaults.get("replicas", 1)), f"{who}: replicas"),
        max_inflight=_positive_int(
            entry.get("max_inflight", defaults.get("max_inflight", 8)), f"{who}: max_inflight"
        ),
        max_queued=_optional_count(entry.get("max_queued"), f"{who}: max_queued"),
        final_output=final_output,
        options={key: value for key, value in entry.items() if key not in _STAGE_KEYS},
    )


def _parse_connector_entry(entry: Any, ref: str, who: str, *, unknown_keys_ok: bool = False) -> ConnectorSpec:
    """One connector; `extra` with variables expanded and numeric strings read as vllm-omni reads them."""
    if not isinstance(entry, dict):
        raise TopologyError(
            f"{who}: a connector is a mapping {{name: <type>, extra: {{...}}}}, got {entry!r}"
        )
    if "name" not in entry:
        raise TopologyError(
            f"{who} has no name: key; set it to a connector type ({', '.join(available_connectors())})"
        )
    name = entry["name"]
    if not isinstance(name, str) or not name:
        raise TopologyError(f"{who}: name must be a connector type such as {AUTO_CONNECTOR!r}, got {name!r}")
    unknown = sorted(set(entry) - _CONNECTOR_KEYS, key=str)
    if unknown and not unknown_keys_ok:
        raise TopologyError(f"{who}: unknown key {unknown[0]!r} (a connector has name: and extra:)")
    extra = entry.get("extra") or {}
    if not isinstance(extra, dict):
        raise TopologyError(f"{who}: extra must be a mapping, got {extra!r}")
    extra = read_extra(extra, _config_class_of(name))
    return ConnectorSpec(ref=ref, name=name, extra=extra, auto=False)


def _config_class_of(connector_name: str) -> Any:
    """The config dataclass of a connector type (None for a type that does not load)."""
    try:
        cls = connector_class(connector_name)
    except (ValueError, ImportError):
        return None  # reported with the edges that use it
    return getattr(cls, "config_class", None)


def _positive_int(value: Any, what: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise TopologyError(f"{what} must be an integer >= 1, got {value!r}")
    return value


def _optional_count(value: Any, what: str) -> int | None:
    """An optional integer >= 0 (null or absent: the default applies)."""
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise TopologyError(f"{what} must be an integer >= 0 (0: never queue), got {value!r}; or leave it out")
    return value


def _describe(stage: StageSpec) -> str:
    return f"stage {stage.stage_id} {stage.name!r}"


def _stage_list(stages: Iterable[StageSpec]) -> str:
    return ", ".join(f"{stage.stage_id} {stage.name!r}" for stage in stages)


def _has_input(sid: int, edges: dict[tuple[int, int], EdgeSpec]) -> bool:
    return any(dst == sid for _, dst in edges)


def _reachable(starts: Iterable[int], neighbours: dict[int, list[int]]) -> set[int]:
    seen: set[int] = set()
    stack = list(starts)
    while stack:
        sid = stack.pop()
        if sid not in seen:
            seen.add(sid)
            stack.extend(neighbours[sid])
    return seen


def _find_cycle(successors: dict[int, list[int]]) -> list[int]:
    """One cycle as a closed walk, e.g. [1, 2, 1]; only called when a cycle exists."""
    state: dict[int, int] = {}  # 1 = on the current path, 2 = done
    path: list[int] = []

    def visit(sid: int) -> list[int] | None:
        state[sid] = 1
        path.append(sid)
        for nxt in sorted(successors[sid]):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        state[sid] = 2
        path.pop()
        return None

    for sid in sorted(successors):
        if sid not in state:
            found = visit(sid)
            if found:
                return found
    raise AssertionError("no cycle found")  # pragma: no cover - callers check first
