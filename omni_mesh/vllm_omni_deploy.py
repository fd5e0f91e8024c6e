"""vllm-omni deploy files: the graph they leave to vllm-omni's code, written into the file's stages.

A deploy file (`vllm_omni/deploy/<model_type>.yaml`) lists `stages:` with settings only: no handler, no
`engine_input_source`, no `edges:`; at most `input_connectors`/`output_connectors` naming the
connector of an edge. vllm-omni takes the graph from the pipeline registered for the model, merges
`base_config:` files under the file first, and ignores a deploy stage the pipeline does not have.
Here the pipeline comes from `omni_mesh.vllm_omni_graphs`; a file whose pipeline is not built in
and that declares no edge is refused, never loaded as stages that each run alone.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from omni_mesh.vllm_omni_graphs import PIPELINES, PipelineGraph, match_pipeline

__all__ = ["DeployFileError", "PreparedFile", "is_deploy_file", "prepare"]

_EDGE_KEY = re.compile(r"^(from|to)_stage_(\d+)$")
# Stage keys vllm-omni merges key by key when an overlay changes a base_config's stage.
_DEEP_MERGE_KEYS = frozenset(
    {"default_sampling_params", "default_pooling_params", "subtalker_sampling_params", "engine_extras", "engine_args"}
)


class DeployFileError(ValueError):
    """The deploy file cannot be given a graph; the message says what to add."""


@dataclass
class PreparedFile:
    data: Any
    is_deploy: bool = False
    graph_from: str | None = None  # which built-in graph the stages got, and why
    warnings: list[str] = field(default_factory=list)
    #: Why the stages have no edges, raised once the stages themselves have passed their own checks.
    missing_graph: str | None = None


def is_deploy_file(data: dict) -> bool:
    """Top-level `stages:` whose entries declare no handler and no engine_input_source, and either a
    `pipeline:` key (vllm-omni's, whatever else the file has) or no edges:."""
    stages = data.get("stages")
    if "stage_args" in data or not isinstance(stages, list) or not stages:
        return False
    if not all(isinstance(stage, dict) for stage in stages):
        return False
    if any("handler" in stage or "engine_input_source" in stage for stage in stages):
        return False
    return data.get("pipeline") is not None or not _edge_entries(data)


def _edge_entries(data: dict) -> list:
    """The `edges:` entries, top level and under `runtime:` (vllm-omni reads both in a deploy file)."""
    runtime = data.get("runtime")
    found = [data.get("edges"), runtime.get("edges") if isinstance(runtime, dict) else None]
    return [entry for entries in found if isinstance(entries, list) for entry in entries]


def prepare(data: Any, *, name: str, base_dir: Path | None) -> PreparedFile:
    """`data` with a deploy file's graph written into its stages; any other file unchanged."""
    if not isinstance(data, dict) or "stage_args" in data:
        return PreparedFile(data)
    base_name = data.get("base_config")
    if base_name is not None:  # an overlay may change only settings: its stages come from the base
        data = _with_base_config(data, base_dir or Path.cwd(), seen=())
    if not is_deploy_file(data):
        return PreparedFile(data)
    if not _ids_well_formed(data["stages"]):
        return PreparedFile(data, is_deploy=True)  # the topology's own checks say what is wrong
    key = data.get("pipeline")
    if isinstance(key, str) and key not in PIPELINES and _declares_edges(data):
        why = f"pipeline: {key!r} names a vllm-omni pipeline whose graph omni-mesh does not know"
        return _declared_graph_only(data, why)
    graph, how = _choose_graph(data, name, base_name)
    if graph is None:
        return _without_graph(data, name)
    stages, warnings = _stages_of(graph, data)
    graph_from = f"vllm-omni pipeline {graph.key!r} ({graph.title}), chosen by {how}"
    if how != "its pipeline: key":
        graph_from += "; vllm-omni picks the pipeline from the model's config: set pipeline: to choose it"
    return PreparedFile({**data, "stages": stages}, True, graph_from, warnings)


# -- choosing the graph ----------------------------------------------------------------------------


def _choose_graph(data: dict, name: str, base_name: Any) -> tuple[PipelineGraph | None, str]:
    key = data.get("pipeline")
    if key is not None:
        graph = PIPELINES.get(key) if isinstance(key, str) else None
        if graph is None:
            raise DeployFileError(
                f"pipeline: {key!r} names a vllm-omni pipeline whose graph omni-mesh does not know "
                f"(built in: {', '.join(PIPELINES)}); {_HOW_TO_DECLARE}"
            )
        return graph, "its pipeline: key"
    candidates = (
        ("its model: key", data.get("model")),
        ("the file name", name),
        ("its base_config: file name", Path(base_name).stem if isinstance(base_name, str) else None),
    )
    for how, candidate in candidates:
        graph = match_pipeline(candidate) if isinstance(candidate, str) and candidate else None
        if graph is not None:
            return graph, f"{how} {candidate!r}"
    return None, ""


_HOW_TO_DECLARE = (
    "declare the edges in the file: engine_input_source: [<upstream stage id>] on each downstream stage, "
    "or edges: [{from: 0, to: 1}] at the top level"
)


def _without_graph(data: dict, name: str) -> PreparedFile:
    stages = data["stages"]
    if _declares_edges(data):
        return _declared_graph_only(data, f"no built-in graph of a vllm-omni pipeline matches {name!r}")
    if len(stages) == 1:
        return PreparedFile(data, is_deploy=True)
    ids = ", ".join(str(stage.get("stage_id")) for stage in stages)
    return PreparedFile(data, is_deploy=True, missing_graph=(
        f"the file lists {len(stages)} stages ({ids}) and no edge between them: a vllm-omni deploy file keeps "
        f"its graph in vllm-omni's pipeline code, and no built-in graph matches {name!r} (built in: "
        f"{', '.join(PIPELINES)}). Set pipeline: to one of those, or {_HOW_TO_DECLARE}"
    ))


def _declares_edges(data: dict) -> bool:
    stages = data["stages"]
    return bool(_edge_entries(data)) or any(
        stage.get("input_connectors") or stage.get("output_connectors") for stage in stages
    )


def _declared_graph_only(data: dict, why: str) -> PreparedFile:
    """The file's own edges, with a warning: vllm-omni takes the graph from code omni-mesh lacks."""
    warning = (
        f"{why} (built in: {', '.join(PIPELINES)}), so the edges are only those the file declares (edges:, "
        "input_connectors/output_connectors), and the final stages those marked final_output: true (where "
        "none is, those with no outgoing edge); vllm-omni takes the graph and the final stages from the "
        "pipeline's code: check them, or set pipeline:"
    )
    return PreparedFile(data, is_deploy=True, warnings=[warning])


# -- writing the graph into the stages -------------------------------------------------------------


def _stages_of(graph: PipelineGraph, data: dict) -> tuple[list[dict], list[str]]:
    entries = data["stages"]
    by_id = {_stage_id(entry.get("stage_id")): entry for entry in entries}
    known = {stage.stage_id: stage for stage in graph.stages}
    for sid in by_id:
        if sid not in known:
            raise DeployFileError(
                f"stage {sid!r} is not a stage of vllm-omni's pipeline {graph.key!r} (stages: "
                f"{graph.describe_stages()}); remove it, or set pipeline: to the pipeline this file is for"
            )
    edges = set(graph.edges)
    for entry in _edge_entries(data):
        edge = (_stage_id(entry.get("from")), _stage_id(entry.get("to"))) if isinstance(entry, dict) else None
        if edge is not None and edge not in edges:
            raise DeployFileError(
                f"edges: declares edge {edge[0]}->{edge[1]}, which vllm-omni's pipeline {graph.key!r} does not "
                f"have (its edges: {graph.describe_edges()}); fix the entry, or set pipeline: to the pipeline "
                "this file is for"
            )
    for sid, entry in by_id.items():
        for edge, where in _connector_edges(entry):
            if edge not in edges:
                raise DeployFileError(
                    f"stage {sid} {where} declares edge {edge[0]}->{edge[1]}, which vllm-omni's pipeline "
                    f"{graph.key!r} does not have (its edges: {graph.describe_edges()}); fix the key, or set "
                    "pipeline: to the pipeline this file is for"
                )
    warnings: list[str] = []
    stages = []
    for stage in graph.stages:
        entry = dict(by_id.get(stage.stage_id) or {"stage_id": stage.stage_id})
        entry.setdefault("name", stage.name)
        if "final_output" in entry and entry["final_output"] != stage.final:
            warnings.append(
                f"stage {stage.stage_id}: final_output: {entry['final_output']!r} is ignored; in vllm-omni's "
                f"pipeline {graph.key!r} the stage is {'' if stage.final else 'not '}final"
            )
        entry["final_output"] = stage.final
        entry["engine_input_source"] = list(stage.inputs)
        stages.append(entry)
    return stages, warnings


def _ids_well_formed(entries: list[dict]) -> bool:
    ids = [_stage_id(entry.get("stage_id")) for entry in entries]
    valid = all(isinstance(sid, int) and not isinstance(sid, bool) and sid >= 0 for sid in ids)
    return valid and len(set(ids)) == len(ids)


def _stage_id(value: Any) -> Any:
    return int(value) if isinstance(value, str) and value.isdigit() else value


def _connector_edges(entry: dict) -> list[tuple[tuple[int, int], str]]:
    """The edges a stage's input_connectors/output_connectors keys declare (malformed keys: none)."""
    sid = _stage_id(entry.get("stage_id"))
    found = []
    for key in ("input_connectors", "output_connectors"):
        mapping = entry.get(key)
        for item in mapping if isinstance(mapping, dict) else ():
            match = _EDGE_KEY.match(str(item))
            if match and isinstance(sid, int):
                other = int(match.group(2))
                edge = (other, sid) if match.group(1) == "from" else (sid, other)
                found.append((edge, f"{key}.{item}"))
    return found


# -- base_config -----------------------------------------------------------------------------------


def _with_base_config(data: dict, base_dir: Path, seen: tuple[Path, ...]) -> dict:
    """`data` merged over its base_config file (itself merged over its own), as vllm-omni merges them:
    top-level keys overlay, connectors merged key by key, stages merged by stage_id."""
    overlay = {key: value for key, value in data.items() if key != "base_config"}
    base_name = data.get("base_config")
    if base_name is None:
        return overlay
    if not isinstance(base_name, str) or not base_name:
        raise DeployFileError(f"base_config: must be the path of another deploy file, got {base_name!r}")
    path = (base_dir / base_name).resolve()
    if path in seen:
        chain = " -> ".join(str(p) for p in (*seen, path))
        raise DeployFileError(f"base_config: files include each other ({chain}); break the loop")
    base = _with_base_config(_read_base(path, base_name), path.parent, (*seen, path))
    merged = {**base, **{k: v for k, v in overlay.items() if k not in ("connectors", "stages")}}
    if isinstance(base.get("connectors"), dict) or isinstance(overlay.get("connectors"), dict):
        merged["connectors"] = _merge_dicts(_mapping(base.get("connectors")), _mapping(overlay.get("connectors")))
    merged["stages"] = _merge_stages(base.get("stages"), overlay.get("stages"))
    return merged


def _read_base(path: Path, written: str) -> dict:
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise DeployFileError(f"base_config: {written!r}: {path} not found; fix the path (it is relative to the file)") from None
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        raise DeployFileError(f"base_config: {written!r}: cannot read {path}: {exc}") from None
    if not isinstance(data, dict):
        raise DeployFileError(f"base_config: {written!r}: {path} is not a deploy file (no mapping at its top)")
    return data


def _merge_stages(base: Any, overlay: Any) -> list:
    merged: dict[Any, Any] = {}
    for entry in [*_list(base), *_list(overlay)]:
        sid = _stage_id(entry.get("stage_id")) if isinstance(entry, dict) else id(entry)
        earlier = merged.get(sid)
        if isinstance(earlier, dict) and isinstance(entry, dict):
            deep = {k: _merge_dicts(earlier[k], entry[k]) for k in _DEEP_MERGE_KEYS & earlier.keys() & entry.keys()
                    if isinstance(earlier[k], dict) and isinstance(entry[k], dict)}
            entry = {**earlier, **entry, **deep}
        merged[sid] = entry
    return list(merged.values())


def _merge_dicts(base: dict, overlay: dict) -> dict:
    merged = dict(base)
    for key, value in overlay.items():
        earlier = merged.get(key)
        merged[key] = _merge_dicts(earlier, value) if isinstance(earlier, dict) and isinstance(value, dict) else value
    return merged


def _mapping(value: Any) -> dict:
    return value if isinstance(value, dict) else {}


def _list(value: Any) -> list:
    return value if isinstance(value, list) else []
