"""Reading a topology file: its YAML, with errors that name the line, its directory on sys.path, and
the handlers its stages name."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

from omni_mesh.handlers import BuiltFromStage, Handler
from omni_mesh.topology.model import StageSpec, Topology, TopologyError
from omni_mesh.topology.parse import parse_topology


def load_topology(path: str | Path) -> Topology:
    """Read and validate a topology file; its directory becomes the topology's `base_dir`."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise TopologyError(f"{path}: topology file not found; check the path") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise TopologyError(f"{path}: cannot read topology file: {exc}") from None
    loader = _KeyLines(text)
    try:
        data = loader.get_single_data()
    except yaml.YAMLError as exc:
        raise TopologyError(_yaml_error_message(path, exc)) from None
    finally:
        loader.dispose()
    if data is None:
        raise TopologyError(f"{path}: the file is empty; a topology needs at least a stages: list")
    base_dir = path.resolve().parent
    try:
        topology = parse_topology(data, source=str(path), base_dir=base_dir, default_name=path.stem)
    except TopologyError as exc:
        line = loader.line_of(exc.key_of)
        if line is None:
            raise
        raise TopologyError(f"{path}:{line}:{str(exc).removeprefix(str(path) + ':')}") from None
    topology.path = path.resolve()
    return topology


class _KeyLines(yaml.SafeLoader):
    """yaml.safe_load that remembers the line of every mapping key, for errors about a key."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self.lines: dict[int, tuple[dict, dict[object, int]]] = {}  # id(mapping) -> (it, {key: line})

    def construct_lines_map(self, node: yaml.MappingNode) -> Iterator[dict]:
        data: dict = {}
        yield data
        data.update(self.construct_mapping(node))
        lines = {self.construct_object(key): key.start_mark.line + 1 for key, _ in node.value}
        self.lines[id(data)] = (data, lines)  # the mapping is kept, so its id stays its own

    def line_of(self, key_of: tuple[object, object] | None) -> int | None:
        if key_of is None:
            return None
        mapping, key = key_of
        entry = self.lines.get(id(mapping))
        return entry[1].get(key) if entry is not None and entry[0] is mapping else None


_KeyLines.add_constructor("tag:yaml.org,2002:map", _KeyLines.construct_lines_map)


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


def load_handler(topology: Topology, stage: StageSpec) -> Handler:
    """What runs a stage's requests: its `engine:` part (loaded by the handler's warm()), or the callable
    its `handler: module:callable` names, imported (a class with `from_stage` is built from the stage's
    settings); ValueError naming the stage."""
    if stage.engine is not None:
        from omni_mesh.engines.stages import engine_handler  # torch and transformers: stage processes only

        upstream = [topology.stage(edge.src).engine or {} for edge in topology.inputs_of(stage.stage_id)]
        return engine_handler(stage.engine, stage.name, fed_by_encoder=any(e.get("part") == "encoder" for e in upstream),
                              feeds_stages=bool(topology.outputs_of(stage.stage_id)))
    handler = import_handler(topology, stage)
    if isinstance(handler, type) and isinstance(handler, BuiltFromStage):  # the class has from_stage
        handler = handler.from_stage(stage.options)
    if not callable(handler):
        raise ValueError(f"stage {stage.name!r}: handler {stage.handler!r} is not callable")
    return handler


def import_handler(topology: Topology, stage: StageSpec) -> Any:
    """The object a stage's `handler: module:callable` names, imported but not built (a class stays
    a class: building one may load a model); ValueError naming the stage."""
    if not stage.handler:
        raise ValueError(
            f"stage {stage.name!r} ({stage.stage_id}) has no handler: set `handler: module:callable`"
        )
    module_name, _, attr = stage.handler.partition(":")
    if not module_name or not attr:
        raise ValueError(f"stage {stage.name!r}: handler {stage.handler!r} must look like 'module:callable'")
    add_to_sys_path(topology)
    try:
        return getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"stage {stage.name!r}: cannot load handler {stage.handler!r}: {exc}") from exc
