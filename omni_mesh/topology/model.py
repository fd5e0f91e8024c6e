"""The validated topology: its stages, edges and connectors, and the error every check raises."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omni_mesh.topology.openai_spec import OpenAISpec

if TYPE_CHECKING:
    from omni_mesh.topology.autoscale import AutoscaleSpec

#: The connector created for an edge that names none (unless the file sets `auto_shm: false`).
AUTO_CONNECTOR = "SharedMemoryConnector"

#: A stage without `max_queued` holds at most this many times its total max_inflight waiting:
#: enough to keep every replica busy through a burst, small enough that a client gets 429 in time
#: to go elsewhere instead of waiting out its deadline in a queue.
QUEUE_FACTOR = 4


class TopologyError(ValueError):
    """The topology is invalid; the message says where and what to change. `key_of`: the mapping and
    the key at fault, when one is, so that the loader can add the key's line."""

    def __init__(self, message: str, *, key_of: tuple[object, object] | None = None) -> None:
        super().__init__(message)
        self.key_of = key_of


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
    #: `engine:` (a real model part, omni_mesh.engines) instead of a handler; checked settings.
    engine: dict | None = field(default=None, hash=False)
    #: `autoscale:` (omni_mesh.topology.autoscale); `replicas` is then the starting count.
    autoscale: AutoscaleSpec | None = None

    @property
    def runnable(self) -> bool:
        """Whether the stage says what to run: a handler or an engine."""
        return self.handler is not None or self.engine is not None

    def describe_work(self) -> str:
        """What the stage runs, as `validate` prints it."""
        if self.engine is not None:
            return f"engine={self.engine['part']}:{self.engine['model']}"
        return f"handler={self.handler or '-'}"

    def queue_limit(self, running_capacity: int = 0) -> int:
        """How many requests may wait for this stage: `max_queued`, or QUEUE_FACTOR x its total
        max_inflight. `running_capacity` is the slots of the replicas registered now, which a
        compose `--scale` can make more than `replicas` x `max_inflight`; the larger one counts."""
        if self.max_queued is not None:
            return self.max_queued
        most = self.autoscale.max_replicas if self.autoscale is not None else self.replicas
        return QUEUE_FACTOR * max(most * self.max_inflight, running_capacity)


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
    openai: OpenAISpec | None = None  # the optional `openai:` section (omni_mesh.topology.openai_spec)

    def stage(self, key: int | str) -> StageSpec:
        """A stage by id or by name (a digit string that is no stage name is taken as an id)."""
        for stage in self.stages:
            if stage.name == key or (
                isinstance(key, int) and not isinstance(key, bool) and stage.stage_id == key
            ):
                return stage
        if isinstance(key, str) and key.isdigit():
            return self.stage(int(key))
        raise TopologyError(f"topology {self.name!r} has no stage {key!r}; stages: {stage_list(self.stages)}")

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
        """Stages with neither a `handler` nor an `engine`: fine for `validate`, refused by `up`."""
        return [stage for stage in self.stages if not stage.runnable]

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
                    "engine": dict(stage.engine) if stage.engine is not None else None,
                    "replicas": stage.replicas,
                    "max_inflight": stage.max_inflight,
                    "max_queued": stage.max_queued,
                    "autoscale": stage.autoscale.to_dict() if stage.autoscale is not None else None,
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


#: The edges of a graph by (src, dst), as the parser merges them.
Edges = dict[tuple[int, int], EdgeSpec]


def describe_stage(stage: StageSpec) -> str:
    """How error messages name a stage: `stage 1 'talker'`."""
    return f"stage {stage.stage_id} {stage.name!r}"


def stage_list(stages: Iterable[StageSpec]) -> str:
    """The stages, as an error message lists them: `0 'thinker', 1 'talker'`."""
    return ", ".join(f"{stage.stage_id} {stage.name!r}" for stage in stages)


def describe_edge(stages: Mapping[int, StageSpec], src: int, dst: int) -> str:
    """How error messages name an edge: `edge 0->1 (thinker -> talker)`."""
    return f"edge {src}->{dst} ({stages[src].name} -> {stages[dst].name})"
